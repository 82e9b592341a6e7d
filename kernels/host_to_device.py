"""Tensors built on the host, moved to the device without a sync.

The attention plans (query tiles, block tables, key chunks) are computed on the host from
sequence lengths the host already knows, then handed to kernels on the device. Moving each
with `t.to(device)` is a copy from pageable memory that PyTorch follows with a stream
synchronisation: the host waits until the GPU has drained everything queued before it,
and the GPU then idles until the host queues more. One plan moved that way cost seven
syncs; the attention backward's key chunks six per layer.

`index_arrays_on` packs them into one pinned buffer and issues a single asynchronous copy;
`moved_without_sync` moves one tensor of any dtype (a packed batch's fields) the same way.
Invariant: the values on the device are exactly the host values; the host never waits.
Safe without holding on to the pinned buffer: PyTorch's caching host allocator does not
hand a pinned block out again before the copy that reads it has finished. A pinned buffer
kept and rewritten every step has no such guard: `CopyFence` is its.
"""

from __future__ import annotations

import torch
from torch import Tensor


def index_arrays_on(device: torch.device | str, *arrays: Tensor) -> list[Tensor]:
    """Each host integer array, as int32 on `device` (same shapes), in one copy at most.

    The results are views of one device buffer: read-only for their users.
    """
    device = torch.device(device)
    flat = [a.reshape(-1).to(torch.int32) for a in arrays]
    packed = torch.cat(flat) if flat else torch.zeros(0, dtype=torch.int32)
    if device.type != "cpu":
        packed = packed.pin_memory().to(device, non_blocking=True)
    out, start = [], 0
    for a, f in zip(arrays, flat, strict=True):
        out.append(packed[start : start + f.numel()].view(a.shape))
        start += f.numel()
    return out


def moved_without_sync(t: Tensor, device: torch.device | str) -> Tensor:
    """`t` (on the host) on `device`: through pinned memory, asynchronously, off the CPU."""
    device = torch.device(device)
    if device.type == "cpu" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class CopyFence:
    """The guard of a pinned host buffer that is rewritten and copied to the device every
    step: `wait()` before writing it returns once the device has read the last copy (a copy
    queued behind a step still in flight may not have run yet); `mark()` after queueing the
    copy. Off CUDA (`pinned` False) both do nothing."""

    def __init__(self, pinned: bool) -> None:
        self._event = torch.cuda.Event() if pinned else None

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()

    def mark(self) -> None:
        if self._event is not None:
            self._event.record()
