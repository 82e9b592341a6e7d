"""The MoE's token <-> slot movements, backward: one pass per token each.

`combine_bwd`: the combine's backward, the experts' row gradients (in y's dtype, or rounded
once to a narrower one: `autograd.TreeCombine`) and the gates'.

The forward (`moe_route.combine_fwd`) is out = h + shared + sum_j gates[t, j] * y[pos[t, j]].
Given g = d loss / d out (N, d):
- d y[pos[t, j]] = gates[t, j] * g[t]  (one fp32 product per element, as the torch
  expression `g * gates` rounds it),
- d gates[t, j] = sum_c y[pos[t, j], c] * g[t, c]  (fp32).
One program takes a block of tokens and walks d once: it loads g's rows once for all k
slots, writes each slot's row of dY where the expert layout put it, and folds the slot's dot
product. Before, the same took an fp32 (N, k, d) product, an `index_copy_`, an `index_select`
and a batched matrix-vector product: ~5 passes over (N, k, d) fp32.
`slot_sum`: the backward of `x[order // k]` (each token's row copied to its k sorted slot
rows): a token's gradient is the fp32 sum of its k slot rows' gradients in slot order (a
fixed reduction, where indexing's backward would add duplicates with atomics), read where
the layout put them, cast once. Before: an `index_select` into an (N, k, d) copy, an fp32
sum and a cast.
Invariants: `pos` is a permutation of the rows of y, so each row of dY is written by one
program exactly once (no atomics); each gate gradient is one program's reduction in a fixed
order, so the bits are the same on every run (and, without FMA contraction, in every
specialisation: with or without the other output).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from rlsys.kernels.triton_ops import pdl
from rlsys.kernels.triton_ops.common import bf16_nearest, check_device, next_pow2

ELEMENTS = 2048  # tokens x d per program (two tokens at d = 1024)


@triton.jit
def _combine_bwd(
    G, Y, POS, GATES, GY, GG, n_rows, d, s_g, s_y, s_pos, s_gates, s_gy, s_gg,
    K: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
    NEED_Y: tl.constexpr, NEED_GATES: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl.wait_prior(PDL)
    pdl.release_next(PDL)
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = r < n_rows
    r64 = r.to(tl.int64)
    c = tl.arange(0, BLOCK)
    slot = tl.arange(0, KP)
    acc = tl.zeros([ROWS, KP], tl.float32)
    for c0 in range(0, d, BLOCK):
        m = live[:, None] & (c0 + c < d)[None, :]
        g = tl.load(G + r64[:, None] * s_g + c0 + c[None, :], mask=m, other=0.0).to(tl.float32)
        for j in tl.static_range(K):
            p = tl.load(POS + r64 * s_pos + j, mask=live, other=0).to(tl.int64)
            if NEED_Y:
                gate = tl.load(GATES + r64 * s_gates + j, mask=live, other=0.0).to(tl.float32)
                gy = g * gate[:, None]
                if GY.dtype.element_ty == tl.bfloat16:  # torch's rounding of the fp32 product
                    gy_out = bf16_nearest(gy)
                else:
                    gy_out = gy.to(GY.dtype.element_ty)
                tl.store(GY + p[:, None] * s_gy + c0 + c[None, :], gy_out, mask=m)
            if NEED_GATES:
                y = tl.load(Y + p[:, None] * s_y + c0 + c[None, :], mask=m, other=0.0)
                dot = tl.sum(y.to(tl.float32) * g, axis=1)
                acc += tl.where(slot[None, :] == j, dot[:, None], 0.0)
    if NEED_GATES:
        keep = live[:, None] & (slot < K)[None, :]
        tl.store(GG + r64[:, None] * s_gg + slot[None, :], acc.to(GG.dtype.element_ty), mask=keep)


def combine_bwd(
    g: Tensor,
    y_sorted: Tensor,
    pos: Tensor,
    gates: Tensor,
    need_y: bool,
    need_gates: bool,
    y_grad_dtype: torch.dtype | None = None,
) -> tuple[Tensor | None, Tensor | None]:
    """(d y_sorted (N * k, d) in `y_grad_dtype` (default y's dtype) or None, d gates (N, k)
    in the gates' dtype or None) for g (N, d); `pos` (N, k) the row of y_sorted each (token,
    slot) read. A bf16 `y_grad_dtype` rounds each fp32 product once to nearest (ties to
    even): bitwise torch's cast of the fp32 gradient."""
    check_device(g, y_sorted, pos, gates)
    n, k = pos.shape
    d = g.shape[1]
    assert g.stride(1) == 1 and y_sorted.stride(1) == 1
    assert pos.stride(1) == 1 and gates.stride(1) == 1
    gy = torch.empty_like(y_sorted, dtype=y_grad_dtype) if need_y else None
    gg = torch.empty(n, k, dtype=gates.dtype, device=g.device) if need_gates else None
    if n and (need_y or need_gates):
        block = min(1024, next_pow2(d))
        rows = max(1, ELEMENTS // block)
        out_y = gy if gy is not None else y_sorted  # a pointer the kernel never writes
        out_g = gg if gg is not None else gates
        _combine_bwd[(triton.cdiv(n, rows),)](
            g, y_sorted, pos, gates, out_y, out_g, n, d, g.stride(0), y_sorted.stride(0),
            pos.stride(0), gates.stride(0), out_y.stride(0), out_g.stride(0),
            K=k, KP=next_pow2(k), BLOCK=block, ROWS=rows, NEED_Y=need_y,
            NEED_GATES=need_gates, enable_fp_fusion=False, **pdl.launch(g.device),
        )  # fmt: skip
    return gy, gg


@triton.jit
def _slot_sum(G, POS, GX, n_rows, d, s_g, s_pos, s_gx,
    K: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
    PDL: tl.constexpr = False):  # fmt: skip
    pdl.wait_prior(PDL)
    pdl.release_next(PDL)
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = r < n_rows
    r64 = r.to(tl.int64)
    c = tl.arange(0, BLOCK)
    for c0 in range(0, d, BLOCK):
        m = live[:, None] & (c0 + c < d)[None, :]
        acc = tl.zeros([ROWS, BLOCK], tl.float32)
        for j in tl.static_range(K):
            p = tl.load(POS + r64 * s_pos + j, mask=live, other=0).to(tl.int64)
            acc += tl.load(G + p[:, None] * s_g + c0 + c[None, :], mask=m, other=0.0).to(tl.float32)
        tl.store(GX + r64[:, None] * s_gx + c0 + c[None, :], acc.to(GX.dtype.element_ty), mask=m)


def slot_sum(g: Tensor, pos: Tensor) -> Tensor:
    """(N, d) in g's dtype: row t = sum_j g[pos[t, j]] in fp32, slots in order; g (N * k, d),
    pos (N, k) the sorted row of each (token, slot)."""
    check_device(g, pos)
    n, k = pos.shape
    d = g.shape[1]
    assert g.stride(1) == 1 and pos.stride(1) == 1
    out = torch.empty(n, d, dtype=g.dtype, device=g.device)
    if n:
        block = min(1024, next_pow2(d))
        rows = max(1, ELEMENTS // block)
        _slot_sum[(triton.cdiv(n, rows),)](
            g, pos, out, n, d, g.stride(0), pos.stride(0), out.stride(0),
            K=k, BLOCK=block, ROWS=rows, **pdl.launch(g.device),
        )  # fmt: skip
    return out
