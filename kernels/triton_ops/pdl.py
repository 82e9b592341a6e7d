"""Programmatic dependent launch (PDL): a kernel's programs start while the kernel before it
in the stream finishes, and wait for it on the device.

Why: a decode step is hundreds of small kernels (`large` at batch 64: ~830, most of them a
few microseconds). Without PDL each launch begins only once the previous kernel has exited
and its writes are flushed, so every kernel pays its launch and ramp-up on the step's
critical path, graphs or not. With PDL (sm_90 and later; a launch attribute), a kernel's
grid is launched once every program of the previous kernel has signalled
(`release_next`) and parks at `wait_prior` until that kernel has completed and its memory
is visible: the launch overlaps the previous kernel's tail.

Invariants:
- A kernel that may be launched with `launch()`'s options calls `wait_prior(PDL)` before
  its first global load or store (the previous kernel may still be writing what it reads,
  or reading memory the allocator has handed it to write), and `release_next(PDL)` after
  it. The next grid launches only once every program of this one has released or exited,
  i.e. once all of them are resident, so its parked programs never take a slot this kernel
  still needs; and since a kernel releases only after its own wait, at most two grids
  (one running, one parked) overlap. Where in a program the release sits (right after the
  wait, or after its main loads) only moves when the next launch may begin.
- Nothing numeric changes: the wait is a barrier before the kernel's first access, so
  every value is computed from the same inputs in the same order (bitwise the launch
  without PDL; `tests/kernels/test_dependent_launch.py`).
- Only inside `dependent_launches(True)`, on CUDA at sm_90 or later, with a Triton that has
  grid dependency control, do launches carry the attribute; elsewhere (the interpreter, the
  CPU, older GPUs) `launch()` gives `PDL=False` and the kernels compile without the waits.
- A kernel that is not PDL-aware (cuBLAS, torch's) is launched without the attribute and
  waits for its predecessor to complete, as always; a PDL kernel after one launches when it
  completes.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch
import triton
import triton.language as tl

from rlsys.kernels.triton_ops.common import interpreting

# Whether decode graphs (`rlsys.engine.decode_graphs`) capture their kernels with dependent
# launches (`RLSYS_PDL=0` turns it off for a process). On: on the H100 (thirty-first
# session) `large` 4K decode went 6.87 -> 6.68 ms of GPU per step at batch 64 and
# 3.48 -> 3.15 ms per step at batch 1, and the GPU tests (graph steps bitwise the eager ones, engine against
# trainer) passed with it; `bench_engine_gpu.py --pdl on,off` is its A/B.
DECODE_GRAPHS = os.environ.get("RLSYS_PDL", "1") == "1"
# Whether the trainer's trunk graphs (`rlsys.model.trunk_graphs`: the blocks' forward and
# backward) capture their Triton kernels with dependent launches. Off: on the H100 it was no
# faster (`large` 2 x 8K graphed, 30,203 -> 29,882 tok/s; the step is 95% busy with kernels
# long enough that a launch's latency is not the gap); `bench_trainer_gpu.py --pdl on,off` is
# its A/B, `RLSYS_PDL_TRAINER=1` turns it on for a process.
TRUNK_GRAPHS = os.environ.get("RLSYS_PDL_TRAINER", "0") == "1"

_active = False  # inside `dependent_launches(True)`
_supported: dict[int, bool] = {}  # CUDA device index -> PDL usable there


def _grid_dependency_control() -> bool:
    """Whether this Triton exposes `gdc_wait` and the `launch_pdl` launch option."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


def supported(device: torch.device) -> bool:
    """PDL can be used for launches on `device` (CUDA, sm_90+, not interpreting)."""
    if device.type != "cuda" or interpreting():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _supported:
        major, _ = torch.cuda.get_device_capability(index)
        _supported[index] = major >= 9 and _grid_dependency_control()
    return _supported[index]


@contextlib.contextmanager
def dependent_launches(on: bool) -> Iterator[None]:
    """Launches inside the block carry the PDL attribute where `supported` (on=False: none
    do, whatever an outer block said)."""
    global _active
    before, _active = _active, on
    try:
        yield
    finally:
        _active = before


def launch(device: torch.device) -> dict[str, Any]:
    """Keyword arguments for a PDL-aware kernel's launch on `device`: the kernel's `PDL`
    constexpr and, when dependent launches are on and supported, the launch attribute."""
    if _active and supported(device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def wait_prior(PDL: tl.constexpr):
    """Wait until the previous kernel in the stream has completed and its writes are
    visible (nothing when `PDL` is off)."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def release_next(PDL: tl.constexpr):
    """Let the next kernel's grid launch once every program of this one got here."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
