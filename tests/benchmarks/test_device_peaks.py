"""The benches' utilisation columns divide by the card that produced the time."""

from __future__ import annotations

import pytest

from benchmarks.device_peaks import PEAKS, peak_for


@pytest.mark.parametrize(
    ("name", "tbps", "tflops"),
    [
        ("NVIDIA H200", 4.8, 989),
        ("NVIDIA H100 80GB HBM3", 3.35, 989),
        ("NVIDIA H100 NVL", 3.9, 835),
        ("NVIDIA H100 PCIe", 2.0, 756),
    ],
)
def test_each_card_is_measured_against_its_own_peaks(name: str, tbps: float, tflops: float):
    peak = peak_for(name)
    assert peak.hbm_bytes_per_s == pytest.approx(tbps * 1e12)
    assert peak.bf16_flops == pytest.approx(tflops * 1e12)


def test_an_unknown_card_is_an_error_that_names_the_overrides(monkeypatch):
    monkeypatch.delenv("RLSYS_PEAK_HBM_TBPS", raising=False)
    with pytest.raises(ValueError, match="RLSYS_PEAK_HBM_TBPS.*RLSYS_PEAK_BF16_TFLOPS"):
        peak_for("NVIDIA B200")


def test_the_overrides_replace_the_registry(monkeypatch):
    monkeypatch.setenv("RLSYS_PEAK_HBM_TBPS", "8.0")
    monkeypatch.setenv("RLSYS_PEAK_BF16_TFLOPS", "2250")
    peak = peak_for("NVIDIA B200")
    assert (peak.hbm_bytes_per_s, peak.bf16_flops) == (8.0e12, 2250e12)


def test_no_registry_key_is_read_as_another_card():
    # every listed card's own name resolves to itself, not to a shorter key it contains
    for key, peak in PEAKS.items():
        assert peak_for(f"NVIDIA {key}") == peak
