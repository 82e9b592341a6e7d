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

from rlsys.kernels.triton_ops import pdl
from rlsys.kernels.triton_ops.common import check_device
from rlsys.kernels.triton_ops.linear import _tree_of
from rlsys.kernels.triton_ops.partials import Partials

CHUNK = 4096
ROW_ELEMENTS = 4096  # elements one RMSNorm program holds (rows x padded width)


@triton.jit
def _rms_norm(
    X, R, H, G, Y, n_rows, n_cols, sx, sr, sh, sy, eps, r_mn,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, HAS_RES: tl.constexpr, R_NCH: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    pdl.wait_prior(PDL)
    pdl.release_next(PDL)
    # ROWS rows per program, each reduced along its own axis-1 slice (same tree per row).
    # HAS_RES: x = X + R (the residual add, fp32) is stored to H, then normalised; R is
    # the balanced tree of R_NCH chunk products r_mn apart (`partials`; 1: R itself).
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.arange(0, BLOCK)
    mask = (row < n_rows)[:, None] & (c < n_cols)[None, :]
    x = tl.load(X + row[:, None] * sx + c[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r = _tree_of(R, row[:, None].to(tl.int64) * sr + c[None, :], r_mn, mask, R_NCH)
        x = x + r.to(tl.float32)
        tl.store(H + row[:, None] * sh + c[None, :], x, mask=mask)
    norm_rows(x, row, c, mask, n_cols, eps, G, Y, sy)


@triton.jit
def norm_rows(x, row, c, mask, n_cols, eps, G, Y, sy):
    """Store the zero-centred RMSNorm of x (ROWS, BLOCK) fp32, rows `row`, columns `c`,
    to Y in its dtype. Every kernel that norms a row calls this, on a tensor of the shape
    `norm_shape` gives, so the reduction (its tree, given the layout) is one."""
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    gamma = tl.load(G + c, mask=c < n_cols, other=0.0).to(tl.float32)
    y = x * inv[:, None] * (1.0 + gamma)[None, :]
    tl.store(Y + row[:, None] * sy + c[None, :], y.to(Y.dtype.element_ty), mask=mask)


def norm_shape(d: int) -> tuple[int, int]:
    """(BLOCK, ROWS): the padded row width and the rows per program of a norm of width d."""
    block = triton.next_power_of_2(d)
    return block, max(1, ROW_ELEMENTS // block)


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


def _rows(x: Tensor) -> Tensor:
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _launch_norm(
    x: Tensor, res: Tensor | Partials | None, gamma: Tensor, eps: float, out_dtype: torch.dtype
) -> tuple[Tensor, Tensor | None]:
    d = x.shape[-1]
    rows = _rows(x)
    out = torch.empty(rows.shape, dtype=out_dtype, device=x.device)
    h = torch.empty(rows.shape, dtype=torch.float32, device=x.device) if res is not None else None
    if rows.shape[0]:
        if isinstance(res, Partials):
            assert res.cols == d and res.rows == rows.shape[0]
            r, r_stride, r_nch, r_mn = res.p, d, res.nch, res.rows * d
        else:
            r = _rows(res) if res is not None else rows
            r_stride, r_nch, r_mn = r.stride(0), 1, 0
        hh = h if h is not None else out
        block, per = norm_shape(d)
        # no FMA contraction: the add, the square sum and the scaling round as written, in
        # every specialisation (with or without the residual, any output dtype)
        _rms_norm[(triton.cdiv(rows.shape[0], per),)](
            rows, r, hh, gamma, out, rows.shape[0], d, rows.stride(0), r_stride,
            hh.stride(0), out.stride(0), eps, r_mn,
            BLOCK=block, ROWS=per, HAS_RES=res is not None, R_NCH=r_nch,
            enable_fp_fusion=False, **pdl.launch(x.device),
        )  # fmt: skip
    shape = (*x.shape[:-1], d)
    return out.view(shape), (h.view(shape) if h is not None else None)


def rms_norm_fwd(
    x: Tensor, gamma: Tensor, eps: float, out_dtype: torch.dtype = torch.float32
) -> Tensor:
    """x (..., d) -> x / rms(x) * (1 + gamma), computed in fp32, stored in `out_dtype`
    (rounded once: the same bits as the fp32 result cast afterwards)."""
    check_device(x, gamma)
    return _launch_norm(x, None, gamma, eps, out_dtype)[0]


def add_rms_norm_fwd(
    h: Tensor, a: Tensor | Partials, gamma: Tensor, eps: float, out_dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """The residual add and the next norm in one launch: (h + a in fp32, its RMSNorm in
    `out_dtype`); bitwise `h + a.float()` followed by `rms_norm_fwd` of the sum. `a` may
    be a product's unreduced chunk products (`partials.Partials`), summed here."""
    check_device(h, a.p if isinstance(a, Partials) else a, gamma)
    y, h_new = _launch_norm(h, a, gamma, eps, out_dtype)
    assert h_new is not None
    return h_new, y


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
