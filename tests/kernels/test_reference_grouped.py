"""The routed experts' reference products in one call (`kernels.reference_grouped`) against
the per-expert calls they replace: bitwise, with empty experts, ragged row counts, both
dtypes and a TP shard's chunk count; and differentiable like the per-expert path."""

from __future__ import annotations

import pytest
import torch

from rlsys.kernels import reference
from rlsys.kernels import reference_grouped as rg
from rlsys.kernels.tp import row_partial

COUNTS = [0, 1, 33, 0, 70, 32]  # an empty expert first and between, tile edges on both sides


def _per_expert(x, w1, w3, w2, counts, chunks):  # noqa: ANN001, ANN202
    outs, start = [], 0
    for e, count in enumerate(counts):
        if count:
            rows = x[start : start + count]
            h = reference.silu(reference.linear(rows, w1[e])) * reference.linear(rows, w3[e])
            outs.append(row_partial(h, w2[e], chunks))
        start += count
    return torch.cat(outs)


def _weights(dtype: torch.dtype, e: int, hid: int, d: int, seed: int = 0):  # noqa: ANN202
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(*shape, generator=g) * 0.1).to(dtype)
        for shape in ((e, hid, d), (e, hid, d), (e, d, hid))
    ]


def _grouped(x, w1, w3, w2, counts, chunks):  # noqa: ANN001, ANN202
    tiles = rg.ExpertTiles.of(counts, x.device)
    xt = tiles.pad(x)
    h = reference.silu(rg.grouped_linear(xt, w1, tiles)) * rg.grouped_linear(xt, w3, tiles)
    return tiles.unpad(rg.grouped_row_partial(h, w2, tiles, chunks))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunks", [8, 2])  # one rank of 1, of 4
def test_one_call_gives_every_expert_the_per_expert_bits(dtype: torch.dtype, chunks: int) -> None:
    d, hid = 48, 40  # neither a multiple of the 32-column tile
    w1, w3, w2 = _weights(dtype, len(COUNTS), hid, d)
    x = torch.randn(sum(COUNTS), d, generator=torch.Generator().manual_seed(1)).to(dtype)
    want = _per_expert(x, w1, w3, w2, COUNTS, chunks)
    got = _grouped(x, w1, w3, w2, COUNTS, chunks)
    assert got.dtype == want.dtype == torch.float32
    assert torch.equal(got, want)


def test_gradients_reach_rows_and_weights_like_the_per_expert_path() -> None:
    d, hid = 32, 64
    params = [w.requires_grad_() for w in _weights(torch.float32, len(COUNTS), hid, d)]
    x = torch.randn(sum(COUNTS), d, generator=torch.Generator().manual_seed(2), requires_grad=True)
    grads = []
    for run in (_per_expert, _grouped):
        out = run(x, *params, COUNTS, 8)
        grads.append(torch.autograd.grad(out.square().sum(), [x, *params]))
    for mine, theirs in zip(*grads, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    assert torch.count_nonzero(grads[1][1][0]) == 0  # an expert without rows: no gradient
