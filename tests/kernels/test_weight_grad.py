"""The weight gradient's split reduction (`autograd.weight_grad`): the row parts and the
remainder sum to `g.T @ x`, and small outputs (the router's, the indexer's block keys) are
cut into many short parts rather than one long reduction per output tile."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from rlsys.kernels.triton_ops.autograd import (  # noqa: E402
    MIN_PART_ROWS,
    SPLIT_ROWS,
    split_parts,
    weight_grad,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(("m", "n", "k"), [(8192 + 37, 32, 1024), (4 * SPLIT_ROWS, 64, 256)])
def test_the_split_reduction_is_the_product(m: int, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(0)
    grad, x = torch.randn(m, n, generator=g), torch.randn(m, k, generator=g)
    out = weight_grad(grad.to(DEV), x.to(DEV))
    assert out.shape == (n, k) and out.dtype == torch.float32
    oracle = grad.double().t() @ x.double()
    torch.testing.assert_close(out.cpu().double(), oracle, atol=1e-3, rtol=1e-5)
    assert torch.equal(out, weight_grad(grad.to(DEV), x.to(DEV)))  # the same bits every run


def test_small_outputs_take_many_short_parts() -> None:
    # the router's (32, 1024) at 8K rows: 64 parts of 128 rows, where one per SPLIT_ROWS
    # rows gave 2 (64 output tiles of 4,096-long dot products)
    assert split_parts(8192, 32 * 1024) == 8192 // MIN_PART_ROWS
    assert split_parts(32768, 1024 * 64) == 32
    # large outputs keep one part per SPLIT_ROWS rows; short inputs stay one product
    assert split_parts(32768, 1024 * 1024) == 32768 // SPLIT_ROWS
    assert split_parts(MIN_PART_ROWS, 32) == 1
