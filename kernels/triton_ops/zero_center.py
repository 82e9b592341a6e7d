"""The zero-center projection's backward (`rlsys.model.logits`) in one launch.

Per row of the logit gradient g (V wide) with the allowed set m (all ones, or a candidate
mask): out = g - m * mean_m(g), in fp32, rounded to g's dtype; then, for a dtype coarser than
fp32, ROUNDS times: the residual row sum over the allowed entries is subtracted from the
allowed entry of smallest magnitude (the first such on ties, as `argmin` picks it), the
difference rounded once. One program per row walks the row in chunks four times (the mean;
the rounded output's residual and smallest entry; the same after the first fix; the store),
recomputing the rounded output from g each time, so nothing is read back from memory it
wrote. It replaces ~40 small torch kernels per call (the mean, the cast, and per round a
sum, an abs, a masked fill, an argmin, a gather, a subtraction and a scatter).
Invariant: a row's result depends on that row only (one program, fixed chunk order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from rlsys.kernels.triton_ops.common import check_device, next_pow2

CHUNK = 2048  # columns per step of a row's walk


@triton.jit
def _load(G, M, row, c, v, s_g, s_m, HAS_MASK: tl.constexpr):
    """(g at columns c in fp32, whether each is allowed: live and in the mask)."""
    live = c < v
    g = tl.load(G + row * s_g + c, mask=live, other=0.0).to(tl.float32)
    if HAS_MASK:
        return g, (tl.load(M + row * s_m + c, mask=live, other=0) != 0) & live
    return g, live


@triton.jit
def _rounded(G, M, row, c, v, mean, i1, fixed1, s_g, s_m, HAS_MASK: tl.constexpr, DT: tl.constexpr):
    """(the row's rounded output at columns c, with the first fix at i1; allowed)."""
    g, allowed = _load(G, M, row, c, v, s_g, s_m, HAS_MASK)
    out = (g - tl.where(allowed, mean, 0.0)).to(DT)
    return tl.where(c == i1, fixed1, out), allowed


@triton.jit
def _zero_center_bwd(
    G, M, OUT, v, s_g, s_m, s_o,
    HAS_MASK: tl.constexpr, ROUNDS: tl.constexpr, CH: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CH)
    DT: tl.constexpr = OUT.dtype.element_ty
    tl.static_assert(ROUNDS <= 2)  # the walks below carry at most two fixes
    total = tl.zeros([CH], tl.float32)
    count = tl.zeros([CH], tl.float32)
    for c0 in range(0, v, CH):
        g, allowed = _load(G, M, row, c0 + c, v, s_g, s_m, HAS_MASK)
        total += tl.where(allowed, g, 0.0)
        count += allowed.to(tl.float32)
    mean = tl.sum(total, axis=0) / tl.maximum(tl.sum(count, axis=0), 1.0)
    i1 = -1  # no fix yet
    fixed1 = tl.zeros([], DT)
    i2 = -1
    fixed2 = tl.zeros([], DT)
    for r in tl.static_range(ROUNDS):
        residual = tl.zeros([CH], tl.float32)
        best = tl.full([], float("inf"), tl.float32)
        best_i = tl.full([], -1, tl.int32)
        best_v = tl.zeros([], DT)
        for c0 in range(0, v, CH):
            out, allowed = _rounded(G, M, row, c0 + c, v, mean, i1, fixed1, s_g, s_m, HAS_MASK, DT)
            residual += tl.where(allowed, out.to(tl.float32), 0.0)
            mag = tl.where(allowed, tl.abs(out.to(tl.float32)), float("inf"))
            lo = tl.min(mag, axis=0)
            at = tl.min(tl.where(mag == lo, c0 + c, v), axis=0)  # first on ties
            better = lo < best  # strictly: an earlier chunk keeps a tie
            best_v = tl.where(
                better, tl.sum(tl.where(c0 + c == at, out, 0.0), axis=0).to(DT), best_v
            )
            best_i = tl.where(better, at, best_i)
            best = tl.where(better, lo, best)
        fixed = (best_v.to(tl.float32) - tl.sum(residual, axis=0)).to(DT)
        if r == 0:
            i1, fixed1 = best_i, fixed
        else:
            i2, fixed2 = best_i, fixed
    for c0 in range(0, v, CH):
        out, _ = _rounded(G, M, row, c0 + c, v, mean, i1, fixed1, s_g, s_m, HAS_MASK, DT)
        out = tl.where(c0 + c == i2, fixed2, out)
        tl.store(OUT + row * s_o + c0 + c, out, mask=c0 + c < v)


def zero_center_bwd(grad: Tensor, mask: Tensor | None, rounds: int) -> Tensor:
    """The projected gradient (grad's shape and dtype) of grad (..., V); `mask` (..., V)
    bool the allowed entries or None (all); `rounds` residual fixes (0 for fp32, at most
    2)."""
    check_device(grad)
    v = grad.shape[-1]
    g = grad.reshape(-1, v)
    g = g if g.stride(-1) == 1 else g.contiguous()
    m = mask.reshape(-1, v) if mask is not None else None
    if m is not None and m.stride(-1) != 1:
        m = m.contiguous()
    out = torch.empty(g.shape, dtype=grad.dtype, device=grad.device)
    if g.shape[0] and v:
        mp = m if m is not None else g  # a pointer the kernel does not read
        _zero_center_bwd[(g.shape[0],)](
            g, mp, out, v, g.stride(0), mp.stride(0), out.stride(0),
            HAS_MASK=m is not None, ROUNDS=rounds, CH=min(CHUNK, next_pow2(v)),
        )  # fmt: skip
    return out.view(grad.shape)
