"""Triton dense kernels (linear, the 8-chunk tree, grouped experts, RMSNorm, log-softmax)
against plain torch, and the row invariance that makes them batch-invariant."""

from __future__ import annotations

import pytest
import torch

from rlsys.kernels import reference

pytest.importorskip("triton")

from rlsys.kernels.triton_ops.linear import (  # noqa: E402
    expert_tiles,
    grouped_tree_fwd,
    linear_fwd,
    linear_tree_fwd,
    swiglu_fwd,
)
from rlsys.kernels.triton_ops.rows import log_softmax_fwd, rms_norm_fwd  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _rand(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape).to(dtype).to(DEV)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_is_the_product_and_a_row_does_not_depend_on_the_batch(dtype: torch.dtype) -> None:
    x, w = _rand(70, 96, dtype=dtype), _rand(40, 96, dtype=dtype)
    y = linear_fwd(x, w)
    want = x.float() @ w.float().T
    tol = 1e-4 if dtype == torch.float32 else 6e-2
    torch.testing.assert_close(y.float(), want, atol=tol * 10, rtol=tol)
    for rows in (slice(5, 6), slice(60, 70), slice(0, 1)):
        assert torch.equal(linear_fwd(x[rows], w), y[rows])
    other = torch.cat([_rand(33, 96, dtype=dtype), x[64:65]])  # same row, another batch
    assert torch.equal(linear_fwd(other, w)[-1], y[64])


def test_tree_subtrees_sum_to_the_whole_tree_bitwise() -> None:
    x, w = _rand(50, 128, dtype=torch.bfloat16), _rand(24, 128, dtype=torch.bfloat16)
    whole = linear_tree_fwd(x, w, 8)
    torch.testing.assert_close(whole, x.float() @ w.float().T, atol=1e-3, rtol=1e-3)
    halves = [linear_tree_fwd(x[:, c : c + 64], w[:, c : c + 64], 4) for c in (0, 64)]
    assert torch.equal(halves[0] + halves[1], whole)  # TP=2: each rank one subtree
    q = [linear_tree_fwd(x[:, c : c + 32], w[:, c : c + 32], 2) for c in range(0, 128, 32)]
    assert torch.equal((q[0] + q[1]) + (q[2] + q[3]), whole)  # TP=4


def test_grouped_experts_match_a_loop_over_experts() -> None:
    e, h, d = 4, 32, 48
    w1, w3, w2 = _rand(e, h, d), _rand(e, h, d), _rand(e, d, h)
    counts = torch.tensor([5, 0, 70, 3], device=DEV)
    x = _rand(int(counts.sum()), d)
    tiles = expert_tiles(counts, 10)
    hidden = swiglu_fwd(x, w1, w3, tiles)
    out = grouped_tree_fwd(hidden, w2, tiles, 8)
    start = 0
    for i, count in enumerate(counts.tolist()):
        rows = slice(start, start + count)
        a1, a3 = x[rows] @ w1[i].T, x[rows] @ w3[i].T
        torch.testing.assert_close(hidden[rows], a1 * torch.sigmoid(a1) * a3, atol=1e-3, rtol=1e-4)
        torch.testing.assert_close(out[rows], hidden[rows] @ w2[i].T, atol=1e-3, rtol=1e-4)
        start += count
    # an expert's row does not depend on how many rows the other experts got
    alone = torch.tensor([0, 0, 1, 0], device=DEV)
    one = swiglu_fwd(x[5:6], w1, w3, expert_tiles(alone, 5))
    assert torch.equal(one, hidden[5:6])


def test_rms_norm_and_log_softmax_match_the_reference_and_are_row_invariant() -> None:
    x, gamma = _rand(37, 100), _rand(100)
    y = rms_norm_fwd(x, gamma, 1e-6)
    torch.testing.assert_close(
        y.cpu(), reference.rms_norm(x.cpu(), gamma.cpu(), 1e-6), atol=1e-5, rtol=1e-5
    )
    assert torch.equal(rms_norm_fwd(x[20:21], gamma, 1e-6), y[20:21])
    z = _rand(5, 9000)
    z[0, 3] = float("-inf")
    lp = log_softmax_fwd(z)
    want = torch.log_softmax(z.cpu(), -1)
    finite = torch.isfinite(want)
    torch.testing.assert_close(lp.cpu()[finite], want[finite], atol=1e-5, rtol=1e-5)
    assert lp[0, 3] == float("-inf")
    assert torch.equal(log_softmax_fwd(z[2:3]), lp[2:3])


def test_rope_kernel_rotates_like_the_reference_and_back() -> None:
    from rlsys.kernels.triton_ops.rope import rope_fwd

    x, pos = _rand(37, 4, 8), torch.arange(5, 42, device=DEV)
    inv = 10000.0 ** (-torch.arange(0, 8, 2, dtype=torch.float32, device=DEV) / 8)
    y = rope_fwd(x, pos, inv)
    angles = pos.float()[:, None] * inv[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    want = torch.cat([x[..., :4] * cos - x[..., 4:] * sin, x[..., 4:] * cos + x[..., :4] * sin], -1)
    torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rope_fwd(y, pos, -inv), x, atol=1e-5, rtol=1e-5)  # the backward
    assert torch.equal(rope_fwd(x[9:10], pos[9:10], inv), y[9:10])


def test_rope_autograd_rotates_the_gradient_back_with_the_cached_inverse(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from rlsys.kernels.triton_ops.rope import rope_fwd
    from rlsys.model.rope import apply_rope, inv_freq

    monkeypatch.setenv("RLSYS_KERNELS", "triton")  # the Triton path on the CPU too
    x, pos, g = _rand(21, 4, 8).requires_grad_(), torch.arange(3, 24, device=DEV), _rand(21, 4, 8)
    y = apply_rope(x, pos, 10000.0)
    y.backward(g)
    inv = inv_freq(8, 10000.0, x.device)
    assert torch.equal(y, rope_fwd(x.detach(), pos, inv))
    assert torch.equal(x.grad, rope_fwd(g, pos, -inv))  # bitwise: negation is exact
