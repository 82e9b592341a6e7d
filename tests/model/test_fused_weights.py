"""`FusedWeight`: the cached concatenation of parameters that inference products read, along
rows (projections) or along the stacked experts' rows (dim 1, the experts' [w1; w3])."""

from __future__ import annotations

import torch

from rlsys.model.fused_weights import FusedWeight, fuse_rows


def test_experts_concatenate_along_their_rows_and_follow_an_update() -> None:
    w1, w3 = torch.randn(4, 6, 8), torch.randn(4, 6, 8)
    cache = FusedWeight(1, dim=1)
    got = cache.get([w1, w3])
    assert got.shape == (4, 12, 8) and cache.offsets == [0, 6]
    assert torch.equal(got, torch.cat([w1, w3], dim=1))
    w3.add_(1.0)  # an optimiser step or a weight load writes in place
    assert torch.equal(cache.get([w1, w3])[:, 6:], w3)
    assert cache.get([w1, w3]) is got  # rebuilt into the same storage (CUDA graphs read it)


def test_aligned_parts_start_at_multiples_along_any_dim() -> None:
    a, b = torch.randn(2, 3, 5), torch.randn(2, 4, 5)
    fused, offsets = fuse_rows([a, b], 8, dim=1)
    assert offsets == [0, 8] and fused.shape == (2, 12, 5)
    assert torch.equal(fused[:, 3:8], torch.zeros(2, 5, 5))
    assert torch.equal(fused[:, 8:], b)
