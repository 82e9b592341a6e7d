"""Reference kernels: correct math, and batch invariance (a row's value never depends on
the rows it is computed with)."""

from __future__ import annotations

import pytest
import torch

from rlsys import kernels

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_row_does_not_depend_on_batch_size_or_position(dtype: torch.dtype) -> None:
    w = torch.randn(96, 64).to(dtype)
    batch = torch.randn(77, 64).to(dtype)
    full = kernels.linear(batch, w)
    torch.testing.assert_close(full.float(), (batch.float() @ w.float().T), atol=0.5, rtol=2e-2)
    for row in (0, 5, 31, 32, 76):
        assert torch.equal(kernels.linear(batch[row : row + 1], w)[0], full[row])
        shifted = torch.cat([torch.randn(row % 7 + 1, 64).to(dtype), batch[row : row + 1]])
        assert torch.equal(kernels.linear(shifted, w)[-1], full[row])


def test_matmul_nt_entry_does_not_depend_on_the_other_rows_or_columns() -> None:
    a, b = torch.randn(45, 16), torch.randn(70, 16)
    full = kernels.matmul_nt(a, b)
    torch.testing.assert_close(full, a @ b.T, atol=1e-5, rtol=1e-5)
    assert torch.equal(kernels.matmul_nt(a[7:8], b[:40]), full[7:8, :40])


def test_block_attention_matches_softmax_attention() -> None:
    i, r, u, s, d = 3, 4, 5, 2, 8
    q, k, v = torch.randn(i, r, d), torch.randn(i, u, s, d), torch.randn(i, u, s, d)
    visible = torch.rand(i, r, u, s) > 0.3
    visible[..., 0, 0] = True
    out, mass = kernels.block_attention(q, k, v, visible, 0.5)
    scores = torch.einsum("ird,iusd->irus", q, k).reshape(i, r, u * s) * 0.5
    scores = scores.masked_fill(~visible.reshape(i, r, u * s), float("-inf"))
    w = torch.softmax(scores, dim=-1)
    torch.testing.assert_close(out, torch.einsum("irk,ikd->ird", w, v.reshape(i, u * s, d)))
    torch.testing.assert_close(mass, w.view(i, r, u, s).sum(-1))


def test_block_attention_is_bitwise_unchanged_by_extra_masked_blocks() -> None:
    q, k, v = torch.randn(2, 4, 8), torch.randn(2, 3, 4, 8), torch.randn(2, 3, 4, 8)
    visible = torch.rand(2, 4, 3, 4) > 0.2
    visible[..., 0, 0] = True
    own, _ = kernels.block_attention(q, k, v, visible, 0.3)
    # a union: masked blocks interleaved between (and after) the query's own blocks
    kw, vw = torch.randn(2, 7, 4, 8), torch.randn(2, 7, 4, 8)
    vis_w = torch.zeros(2, 4, 7, 4, dtype=torch.bool)
    for src, dst in enumerate((1, 3, 4)):
        kw[:, dst], vw[:, dst], vis_w[:, :, dst] = k[:, src], v[:, src], visible[:, :, src]
    union, _ = kernels.block_attention(q, kw, vw, vis_w, 0.3)
    assert torch.equal(own, union)


def test_rms_norm_and_log_softmax_are_fp32_and_row_invariant() -> None:
    x = torch.randn(50, 32).to(torch.bfloat16)
    gamma = torch.randn(32) * 0.1
    y = kernels.rms_norm(x, gamma, 1e-6)
    assert y.dtype == torch.float32
    assert torch.equal(kernels.rms_norm(x[3:4], gamma, 1e-6)[0], y[3])
    logits = torch.randn(50, 300)
    lp = kernels.log_softmax(logits)
    assert torch.equal(kernels.log_softmax(logits[9:10])[0], lp[9])
    torch.testing.assert_close(lp.exp().sum(-1), torch.ones(50))


def test_sigmoid_and_silu_do_not_depend_on_tensor_position() -> None:
    x = torch.randn(100_003) * 6
    full_sig, full_silu = kernels.sigmoid(x), kernels.silu(x)
    for lo in (0, 1, 17, 50_000, 100_000):
        assert torch.equal(kernels.sigmoid(x[lo : lo + 3]), full_sig[lo : lo + 3])
        assert torch.equal(kernels.silu(x[lo : lo + 3]), full_silu[lo : lo + 3])
    torch.testing.assert_close(full_sig, torch.sigmoid(x))


def test_moe_combine_folds_slots_in_order() -> None:
    out, gates, shared = torch.randn(6, 3, 4), torch.rand(6, 3), torch.randn(6, 4)
    expected = shared + (gates[..., None] * out).sum(1)
    torch.testing.assert_close(kernels.moe_combine(out, gates, shared), expected)
