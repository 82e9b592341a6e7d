"""Row-wise reductions with one program per row: RMSNorm and log-softmax.

Why not torch's reductions on the GPU: their launch configuration (how many threads or
blocks share one row) depends on the tensor's shape, so the sum of one row changes with the
number of rows (the batch). Here one program owns a row and reduces it in a fixed order
(fixed chunk width, chunks folded in ascending order), whatever else is in the call.
Backward passes are plain torch (training needs no batch invariance).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from rlsys.kernels.triton_ops.common import check_device

CHUNK = 4096
ROW_ELEMENTS = 4096  # elements one RMSNorm program holds (rows x padded width)


@triton.jit
def _rms_norm(X, G, Y, n_rows, n_cols, sx, sy, eps, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    # ROWS rows per program, each reduced along its own axis-1 slice (same tree per row)
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, BLOCK)
    mask = (row < n_rows)[:, None] & (c < n_cols)[None, :]
    x = tl.load(X + row[:, None] * sx + c[None, :], mask=mask, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    gamma = tl.load(G + c, mask=c < n_cols, other=0.0).to(tl.float32)
    tl.store(
        Y + row[:, None] * sy + c[None, :], x * inv[:, None] * (1.0 + gamma)[None, :], mask=mask
    )


@triton.jit
def _log_softmax(X, Y, n_cols, sx, sy, CHUNK: tl.constexpr):
    row = tl.program_id(0)
    c = tl.arange(0, CHUNK)
    m = tl.full([CHUNK], float("-inf"), tl.float32)
    for start in range(0, n_cols, CHUNK):
        x = tl.load(X + row * sx + start + c, mask=start + c < n_cols, other=float("-inf"))
        m = tl.maximum(m, x.to(tl.float32))
    row_max = tl.max(m, axis=0)
    row_max = tl.where(row_max == float("-inf"), 0.0, row_max)
    acc = tl.zeros([CHUNK], tl.float32)
    for start in range(0, n_cols, CHUNK):
        x = tl.load(X + row * sx + start + c, mask=start + c < n_cols, other=float("-inf"))
        acc += tl.exp(x.to(tl.float32) - row_max)
    lse = row_max + tl.log(tl.sum(acc, axis=0))
    for start in range(0, n_cols, CHUNK):
        x = tl.load(X + row * sx + start + c, mask=start + c < n_cols, other=0.0)
        tl.store(Y + row * sy + start + c, x.to(tl.float32) - lse, mask=start + c < n_cols)


def rms_norm_fwd(x: Tensor, gamma: Tensor, eps: float) -> Tensor:
    """x (..., d) -> fp32 x / rms(x) * (1 + gamma)."""
    check_device(x, gamma)
    d = x.shape[-1]
    rows = x.reshape(-1, d)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=torch.float32, device=x.device)
    if rows.shape[0]:
        block = triton.next_power_of_2(d)
        per = max(1, ROW_ELEMENTS // block)
        _rms_norm[(triton.cdiv(rows.shape[0], per),)](
            rows, gamma, out, rows.shape[0], d, rows.stride(0), out.stride(0), eps,
            BLOCK=block, ROWS=per,
        )  # fmt: skip
    return out.view(*x.shape[:-1], d)


def log_softmax_fwd(x: Tensor) -> Tensor:
    """fp32 log-softmax over the last dim."""
    check_device(x)
    v = x.shape[-1]
    rows = x.reshape(-1, v)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=torch.float32, device=x.device)
    if rows.shape[0]:
        chunk = min(CHUNK, triton.next_power_of_2(v))
        _log_softmax[(rows.shape[0],)](rows, out, v, rows.stride(0), out.stride(0), CHUNK=chunk)
    return out.view(*x.shape[:-1], v)
