"""SwiGLU's element-wise halves: `silu(a1) * a3` and its gradient, one Triton kernel each.

The products `a1 = x w1^T`, `a3 = x w3^T` run elsewhere (cuBLAS or a grouped GEMM, see
`products.py`); these kernels join them. Each element is computed from its own inputs only
(no reduction), so a row's value does not depend on the batch: `silu_mul` is as
batch-invariant as the products feeding it. The formula is the Triton tree kernel's
(`linear._swiglu`): `a1 / (1 + exp(-a1)) * a3` in fp32, rounded once to the output dtype.

Inputs may be the two halves of one (rows, 2H) product (`a13`: columns [0, H) are a1,
[H, 2H) a3), which is how the backward recomputes them with one GEMM.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from rlsys.kernels.triton_ops import pdl
from rlsys.kernels.triton_ops.common import check_device

BLOCK = 1024


@triton.jit
def _silu_mul(A1, A3, Y, n_cols, s_a, s_y, total, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl.wait_prior(PDL)
    pdl.release_next(PDL)
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < total
    row, col = idx // n_cols, idx % n_cols
    a1 = tl.load(A1 + row * s_a + col, mask=mask, other=0.0).to(tl.float32)
    a3 = tl.load(A3 + row * s_a + col, mask=mask, other=0.0).to(tl.float32)
    y = a1 / (1.0 + tl.exp(-a1)) * a3
    tl.store(Y + row * s_y + col, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_bwd(
    A1, A3, G, D1, D3, n_cols, s_a, s_g, s_d, total, BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """d a1 = g a3 s (1 + a1 (1 - s)), d a3 = g a1 s, s = sigmoid(a1) (fp32 math)."""
    pdl.wait_prior(PDL)
    pdl.release_next(PDL)
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < total
    row, col = idx // n_cols, idx % n_cols
    a1 = tl.load(A1 + row * s_a + col, mask=mask, other=0.0).to(tl.float32)
    a3 = tl.load(A3 + row * s_a + col, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + row * s_g + col, mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-a1))
    d3 = g * a1 * sig
    d1 = g * a3 * sig * (1.0 + a1 * (1.0 - sig))
    tl.store(D1 + row * s_d + col, d1.to(D1.dtype.element_ty), mask=mask)
    tl.store(D3 + row * s_d + col, d3.to(D3.dtype.element_ty), mask=mask)


def _halves(a1: Tensor, a3: Tensor) -> None:
    assert a1.shape == a3.shape and a1.stride() == a3.stride() and a1.stride(-1) == 1, (
        "a1 and a3: same (rows, H) layout, unit column stride"
    )


def silu_mul(a1: Tensor, a3: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
    """`silu(a1) * a3` (rows, H) in `out_dtype` (default a1's); a1/a3 may be views."""
    check_device(a1, a3)
    _halves(a1, a3)
    rows, h = a1.shape
    out = torch.empty(rows, h, dtype=out_dtype or a1.dtype, device=a1.device)
    if out.numel():
        _silu_mul[(triton.cdiv(out.numel(), BLOCK),)](
            a1, a3, out, h, a1.stride(0), out.stride(0), out.numel(), BLOCK=BLOCK,
            **pdl.launch(a1.device),
        )  # fmt: skip
    return out


def silu_mul_bwd(a13: Tensor, g: Tensor) -> Tensor:
    """Gradient (rows, 2H) w.r.t. `a13 = [a1 | a3]` of `silu(a1) * a3`, given its gradient
    g (rows, H); in a13's dtype (the layout the backward's single GEMM consumes)."""
    check_device(a13, g)
    rows, h2 = a13.shape
    h = h2 // 2
    assert g.shape == (rows, h) and g.stride(-1) == 1 and a13.stride(-1) == 1
    d = torch.empty_like(a13, memory_format=torch.contiguous_format)
    if rows:
        total = rows * h
        _silu_mul_bwd[(triton.cdiv(total, BLOCK),)](
            a13, a13[:, h:], g, d, d[:, h:], h, a13.stride(0), g.stride(0), d.stride(0),
            total, BLOCK=BLOCK, **pdl.launch(a13.device),
        )  # fmt: skip
    return d
