"""Rotary embedding in one launch (the torch form is about ten elementwise launches).

Elementwise per (row, head, pair): the rotation of a position depends on that position
alone, so a token gets the same q/k in any call. `inv_freq` comes in precomputed (one
tensor per head dim), so the angles are the same fp32 products torch forms.
`rotate` is shared with the fused projection epilogue (`qkv_post`); both launch without FMA
contraction, so the rotation rounds as written and a fused and an unfused rotation of the
same input give the same bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from rlsys.kernels.triton_ops import pdl
from rlsys.kernels.triton_ops.common import check_device

ROWS = 16  # (row, head) pairs per program


@triton.jit
def rotate(x1, x2, pos, inv):
    """(x1 cos - x2 sin, x2 cos + x1 sin) at angles pos * inv, in fp32."""
    ang = pos * inv
    c, s = tl.cos(ang), tl.sin(ang)
    return x1 * c - x2 * s, x2 * c + x1 * s


@triton.jit
def _rope(
    X,
    Y,
    POS,
    INV,
    n_pairs,
    H,
    sx_n,
    sx_h,
    sy_n,
    sy_h,
    HALF: tl.constexpr,
    HP: tl.constexpr,
    ROWS: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl.wait_prior(PDL)
    pdl.release_next(PDL)
    pair = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = pair < n_pairs
    n = (pair // H).to(tl.int64)
    h = pair % H
    i = tl.arange(0, HP)
    cols = i < HALF
    mask = live[:, None] & cols[None, :]
    pos = tl.load(POS + n, mask=live, other=0).to(tl.float32)
    inv = tl.load(INV + i, mask=cols, other=0.0)
    base = X + n[:, None] * sx_n + h[:, None] * sx_h + i[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    y1, y2 = rotate(x1, x2, pos[:, None], inv[None, :])
    out = Y + n[:, None] * sy_n + h[:, None] * sy_h + i[None, :]
    tl.store(out, y1.to(Y.dtype.element_ty), mask=mask)
    tl.store(out + HALF, y2.to(Y.dtype.element_ty), mask=mask)


def rope_fwd(x: Tensor, positions: Tensor, inv_freq: Tensor) -> Tensor:
    """x (N, H, D) rotated by positions (N,) with inv_freq (D/2,) fp32; x's dtype."""
    check_device(x, positions, inv_freq)
    n, h, d = x.shape
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # contiguous, whatever x is
    pairs = n * h
    if pairs:
        _rope[(triton.cdiv(pairs, ROWS),)](
            x, y, positions, inv_freq, pairs, h,
            x.stride(0), x.stride(1), y.stride(0), y.stride(1),
            HALF=d // 2, HP=triton.next_power_of_2(d // 2), ROWS=ROWS, enable_fp_fusion=False,
            **pdl.launch(x.device),
        )  # fmt: skip
    return y
