"""The peaks a benchmark divides by: HBM bytes/s and dense bf16 FLOP/s of the card it ran on.

Invariants:
- A utilisation (HBM share, MFU) is always against the card that produced the time: the
  peak is looked up from `torch.cuda.get_device_name()` in `PEAKS`, a registry (the longest
  key contained in the name wins, so "H100 NVL" is not read as another H100).
- A card not in the registry is an error that names the override variables
  (`RLSYS_PEAK_HBM_TBPS`, `RLSYS_PEAK_BF16_TFLOPS`), never a silent default. Until
  2026-12-05 every bench divided by the H200's 4.8 TB/s and 989 TFLOP/s, so an H100's decode
  read 27.7% of HBM where it used 39.7% of its own.
- Without a GPU (the CPU smoke runs, which time the interpreter, not a card) the reference
  card's figures are used, and `describe` says so.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

REFERENCE = "H200"  # the card the issues' goals are stated for


@dataclass(frozen=True)
class DevicePeak:
    """Datasheet peaks of one card (SXM forms unless the name says otherwise)."""

    name: str
    hbm_bytes_per_s: float
    bf16_flops: float  # dense (no 2:4 sparsity)


PEAKS: dict[str, DevicePeak] = {
    "H200": DevicePeak("H200", 4.8e12, 989e12),
    "H100 80GB HBM3": DevicePeak("H100 SXM", 3.35e12, 989e12),
    "H100 NVL": DevicePeak("H100 NVL", 3.9e12, 835e12),
    "H100 PCIe": DevicePeak("H100 PCIe", 2.0e12, 756e12),
    "A100-SXM4-80GB": DevicePeak("A100 SXM 80GB", 2.039e12, 312e12),
    "A100-SXM4-40GB": DevicePeak("A100 SXM 40GB", 1.555e12, 312e12),
}


def peak_for(device_name: str) -> DevicePeak:
    """The registry's peaks for a card named as `torch.cuda.get_device_name()` names it;
    both environment overrides together replace them (for a card not listed)."""
    hbm, flops = os.environ.get("RLSYS_PEAK_HBM_TBPS"), os.environ.get("RLSYS_PEAK_BF16_TFLOPS")
    if hbm and flops:
        return DevicePeak(f"{device_name} (overridden)", float(hbm) * 1e12, float(flops) * 1e12)
    matches = [key for key in PEAKS if key in device_name]
    if not matches:
        raise ValueError(
            f"no peak figures for the GPU {device_name!r} (known: {', '.join(PEAKS)}); set "
            "RLSYS_PEAK_HBM_TBPS and RLSYS_PEAK_BF16_TFLOPS to its datasheet's HBM TB/s and "
            "dense bf16 TFLOP/s"
        )
    return PEAKS[max(matches, key=len)]


def device_peak() -> DevicePeak:
    """The peaks of this process's GPU, or the reference card's where there is none."""
    if not torch.cuda.is_available():
        return PEAKS[REFERENCE]
    return peak_for(torch.cuda.get_device_name())


def describe(peak: DevicePeak) -> str:
    """One line for a table's header: which peaks its utilisation columns divide by."""
    source = "" if torch.cuda.is_available() else f" (no GPU: the reference {REFERENCE}'s)"
    return (
        f"peaks{source}: {peak.name}, HBM {peak.hbm_bytes_per_s / 1e12:.2f} TB/s, "
        f"bf16 {peak.bf16_flops / 1e12:.0f} TFLOP/s dense"
    )
