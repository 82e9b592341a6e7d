"""Rotary embedding in one launch (the torch form is about ten elementwise launches).

Elementwise per (row, head, pair): the rotation of a position depends on that position
alone, so a token gets the same q/k in any call. `inv_freq` comes in precomputed (one
tensor per head dim), so the angles are the same fp32 products torch forms.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from rlsys.kernels.triton_ops.common import check_device

ROWS = 16  # (row, head) pairs per program


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
):
    pair = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = pair < n_pairs
    n = (pair // H).to(tl.int64)
    h = pair % H
    i = tl.arange(0, HP)
    cols = i < HALF
    mask = live[:, None] & cols[None, :]
    pos = tl.load(POS + n, mask=live, other=0).to(tl.float32)
    inv = tl.load(INV + i, mask=cols, other=0.0)
    ang = pos[:, None] * inv[None, :]
    c, s = tl.cos(ang), tl.sin(ang)
    base = X + n[:, None] * sx_n + h[:, None] * sx_h + i[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    out = Y + n[:, None] * sy_n + h[:, None] * sy_h + i[None, :]
    tl.store(out, (x1 * c - x2 * s).to(Y.dtype.element_ty), mask=mask)
    tl.store(out + HALF, (x2 * c + x1 * s).to(Y.dtype.element_ty), mask=mask)


def rope_fwd(x: Tensor, positions: Tensor, inv_freq: Tensor) -> Tensor:
    """x (N, H, D) rotated by positions (N,) with inv_freq (D/2,) fp32; x's dtype."""
    check_device(x, positions, inv_freq)
    n, h, d = x.shape
    y = torch.empty_like(x)
    pairs = n * h
    if pairs:
        _rope[(triton.cdiv(pairs, ROWS),)](
            x, y, positions, inv_freq, pairs, h,
            x.stride(0), x.stride(1), y.stride(0), y.stride(1),
            HALF=d // 2, HP=triton.next_power_of_2(d // 2), ROWS=ROWS,
        )  # fmt: skip
    return y
