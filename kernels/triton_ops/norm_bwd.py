"""RMSNorm's backward in one kernel (the forward is `rows.rms_norm_fwd`).

For `y = x * r * (1 + gamma)`, `r = 1 / sqrt(mean(x^2) + eps)`, with upstream gradient g:
`dx = r * g (1 + gamma) - x * r^3 * mean(g (1 + gamma) x)` per row, and
`dgamma = sum over rows of g * x * r`. One program walks a fixed run of rows (ROWS at a time)
and keeps its dgamma partial in registers; the partials are summed by one torch reduction.
The split of rows over programs depends on the row count only, so the gradient is the same
bits on every run (the activation-checkpointing test holds recomputed gradients to equal).
All math in fp32. It replaces torch's autograd over the reference formula (about ten
full-tensor kernels per norm in fp32).

`add_rms_norm_bwd` is the backward of the residual add and norm (`rows.add_rms_norm_fwd`:
h' = h + a, y = norm(h')): the same walk also adds the residual path's gradient to dx,
giving dh (fp32), and stores it once more cast to a's dtype (da): the add's and the cast's
backward kernels are folded in.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from rlsys.kernels.triton_ops import pdl
from rlsys.kernels.triton_ops.common import check_device, interpreting

ROW_ELEMENTS = 4096  # elements of one ROWS x BLOCK step
PROGRAMS = 528  # 4 per SM of an H200; fewer when there are fewer row steps


@triton.jit
def _rms_norm_bwd(
    X, G, GAMMA, DX, DG, GR, DA, n_rows, n_cols, sx, sg, sdx, sgr, sda, eps, rows_per_program,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, HAS_RES: tl.constexpr, HAS_DA: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    pdl.wait_prior(PDL)
    pdl.release_next(PDL)
    pid = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    cmask = c < n_cols
    gamma1 = 1.0 + tl.load(GAMMA + c, mask=cmask, other=0.0).to(tl.float32)
    dg = tl.zeros([BLOCK], tl.float32)
    first = pid * rows_per_program
    for start in range(0, rows_per_program, ROWS):
        local = start + tl.arange(0, ROWS)
        row = (first + local).to(tl.int64)
        mask = ((row < n_rows) & (local < rows_per_program))[:, None] & cmask[None, :]
        x = tl.load(X + row[:, None] * sx + c[None, :], mask=mask, other=0.0).to(tl.float32)
        g = tl.load(G + row[:, None] * sg + c[None, :], mask=mask, other=0.0).to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n_cols + eps)
        gy = g * gamma1[None, :]
        dot = tl.sum(gy * x, axis=1) / n_cols
        dx = r[:, None] * gy - x * (r * r * r * dot)[:, None]
        if HAS_RES:  # the residual path's gradient joins the norm's
            dx += tl.load(GR + row[:, None] * sgr + c[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + row[:, None] * sdx + c[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        if HAS_DA:
            tl.store(DA + row[:, None] * sda + c[None, :], dx.to(DA.dtype.element_ty), mask=mask)
        dg += tl.sum(g * x * r[:, None], axis=0)
    tl.store(DG + pid * n_cols + c, dg, mask=cmask)


def rms_norm_bwd(x: Tensor, gamma: Tensor, g: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(dx in x's dtype, dgamma in gamma's dtype) of `rms_norm_fwd(x, gamma, eps)`."""
    dx, _, dgamma = _launch(x, gamma, g, None, None, eps)
    return dx, dgamma


def add_rms_norm_bwd(
    h: Tensor, gamma: Tensor, g: Tensor, g_res: Tensor | None, eps: float, a_dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor]:
    """(dh fp32, da in `a_dtype`, dgamma) of `(h, y) = add_rms_norm_fwd(h0, a, gamma, ...)`:
    `h` the saved sum, `g` the gradient of y, `g_res` that of h (None: no gradient there);
    dh = g_res + d norm / d h, and da is dh cast once."""
    return _launch(h, gamma, g, g_res, a_dtype, eps)  # type: ignore[return-value]


def _launch(
    x: Tensor,
    gamma: Tensor,
    g: Tensor,
    g_res: Tensor | None,
    a_dtype: torch.dtype | None,
    eps: float,
) -> tuple[Tensor, Tensor | None, Tensor]:
    check_device(x, gamma, g)
    d = x.shape[-1]
    rows = x.reshape(-1, d)
    grads = g.reshape(-1, d)
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    grads = grads if grads.stride(-1) == 1 else grads.contiguous()
    res = g_res.reshape(-1, d) if g_res is not None else None
    res = res if res is None or res.stride(-1) == 1 else res.contiguous()
    n = rows.shape[0]
    dx = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    da = torch.empty(rows.shape, dtype=a_dtype, device=x.device) if a_dtype is not None else None
    block = triton.next_power_of_2(d)
    per = max(1, ROW_ELEMENTS // block)
    programs = max(1, min(triton.cdiv(n, per), 4 if interpreting() else PROGRAMS))
    rows_per_program = triton.cdiv(triton.cdiv(n, programs), per) * per
    # every program stores its whole partial row (0 where it has no rows): no fill launch
    alloc = torch.empty if n else torch.zeros
    partial = alloc(programs, d, dtype=torch.float32, device=x.device)
    if n:
        gr = res if res is not None else grads  # pointers the kernel does not touch
        out_a = da if da is not None else dx
        _rms_norm_bwd[(programs,)](
            rows, grads, gamma, dx, partial, gr, out_a, n, d, rows.stride(0), grads.stride(0),
            dx.stride(0), gr.stride(0), out_a.stride(0), eps, rows_per_program,
            BLOCK=block, ROWS=per, HAS_RES=res is not None, HAS_DA=da is not None,
            **pdl.launch(x.device),
        )  # fmt: skip
    dgamma = partial.sum(0).to(gamma.dtype)
    return dx.view(x.shape), (da.view(x.shape) if da is not None else None), dgamma
