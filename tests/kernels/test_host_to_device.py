"""Host-built index arrays and batches reach the device with their exact values, and on a
GPU without a single synchronisation (`torch.cuda.set_sync_debug_mode("error")` raises on
any blocking copy or device read)."""

from __future__ import annotations

import pytest
import torch

from rlsys.kernels.attention_plan import Span, contiguous_table, plan_tiles
from rlsys.kernels.host_to_device import index_arrays_on, moved_without_sync

CUDA = torch.cuda.is_available()
DEVICES = ["cpu"] + (["cuda"] if CUDA else [])


@pytest.mark.parametrize("device", DEVICES)
def test_index_arrays_keep_their_values_and_shapes(device: str) -> None:
    arrays = [
        torch.arange(7),
        torch.tensor([[3, -1], [5, 2**30]]),
        torch.zeros(0, dtype=torch.int64),
    ]
    moved = index_arrays_on(device, *arrays)
    for a, m in zip(arrays, moved, strict=True):
        assert m.device.type == device and m.dtype == torch.int32 and m.shape == a.shape
        assert torch.equal(m.cpu(), a.to(torch.int32))


@pytest.mark.parametrize("device", DEVICES)
def test_a_moved_tensor_keeps_its_dtype_and_values(device: str) -> None:
    for t in (torch.randn(5, 3), torch.tensor([True, False]), torch.arange(4)):
        m = moved_without_sync(t, device)
        assert m.device.type == device and m.dtype == t.dtype and torch.equal(m.cpu(), t)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_plans_and_batches_reach_the_gpu_without_a_sync() -> None:
    from rlsys.kernels.triton_ops.attention_bwd import _key_chunks

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tiles = plan_tiles([Span(0, 0, 300, 0), Span(1, 300, 77, 0)], 64, "cuda")
        contiguous_table([300, 77], 64, "cuda")
        _key_chunks([300, 77], tiles, 64, torch.device("cuda"))
        moved_without_sync(torch.randn(1000), "cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert tiles.q_pos.shape[0] == 377 and int(tiles.q_pos[-1]) == 76
