"""`torch.autograd.Function` wrappers: batch-invariant forward, fast backward.

Each wrapper's forward is the product the dispatcher picks (`products.py`: cuBLAS where it
is batch-invariant, the Triton kernels elsewhere); its backward is the plain math of the
same function on cuBLAS and grouped GEMMs (grad of x @ w.T is g @ w and g.T @ x, ...),
because only the forward value must agree between engine and trainer. Invariant: no
backward reads a device value on the host (the MoE's expert offsets stay on the device).
Attention's backward is the Triton backward (`attention_bwd`): dense torch would need the
L x L matrix.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import Tensor

from rlsys.kernels.triton_ops import rows
from rlsys.kernels.triton_ops.norm_bwd import add_rms_norm_bwd, rms_norm_bwd
from rlsys.kernels.triton_ops.products import grouped_mm, products
from rlsys.kernels.triton_ops.swiglu import silu_mul_bwd

SPLIT_ROWS = 4096  # rows per part of a weight gradient's reduction (`weight_grad`)
# small outputs (the router's 32 x 1024, the indexer's blocks x 64) take more, shorter
# parts: enough that the parts' partial products hold this many elements, each part at
# least MIN_PART_ROWS long (the partials are summed by one fp32 reduction)
PARTIAL_ELEMENTS = 2**21
MIN_PART_ROWS = 128
# The routed experts' w1 and w3 gradients as two grouped GEMMs, each contiguous (True), or
# as the halves of one (False: strided views); `RLSYS_SPLIT_EXPERT_GRADS=0`, a benchmark's
# switch
SPLIT_EXPERT_GRADS = os.environ.get("RLSYS_SPLIT_EXPERT_GRADS", "1") == "1"
# The SwiGLUs' backward reads the forward's product a13 = x [w1; w3]^T, kept from the forward
# where the forward made it whole (cuBLAS, the grouped GEMM), rather than recomputing it: one
# GEMM fewer per SwiGLU and step (of five), for a bf16 (rows, 2H) activation kept per layer
# (`large` at 2 x 8K: 128 MB per MoE layer, ~6 GB over 48). Under activation checkpointing
# it is kept only while a block's recomputed forward is alive. `RLSYS_KEEP_SWIGLU_PRODUCT=0`
# recomputes it (a memory-bound job's switch).
KEEP_SWIGLU_PRODUCT = os.environ.get("RLSYS_KEEP_SWIGLU_PRODUCT", "1") == "1"
# The MoE's down projection and combine as one node (`TreeCombine`: the rows' gradient
# written once in bf16, not in fp32 and cast; the same bits) rather than `GroupedTree` then
# `Combine`. Off until it has run on a GPU (thirty-sixth session: tested on the CPU only, no
# device time left); `RLSYS_TREE_COMBINE=1` turns it on.
TREE_COMBINE = os.environ.get("RLSYS_TREE_COMBINE", "0") == "1"


def weight_grad(g: Tensor, x: Tensor) -> Tensor:
    """`g.T @ x` (N, K) for g (M, N), x (M, K): a weight's gradient, reduced over the rows.

    With cuBLAS's workspace at zero (`products.py`) cuBLAS cannot split this long reduction
    over thread blocks, and an (N, K) output of 1024 x 1024 is only 32-64 output tiles for
    132 SMs. So the rows are cut into parts (`split_parts`), one batched GEMM gives each
    part's product, and the parts are summed in fp32 (a fixed order: the backward needs no
    batch invariance, only the same bits on every run)."""
    m = g.shape[0]
    parts = split_parts(m, g.shape[1] * x.shape[1])
    if parts < 2:
        return g.t() @ x
    rows = m // parts
    main = parts * rows
    gp = g[:main].reshape(parts, rows, -1).transpose(1, 2)
    total = torch.bmm(gp, x[:main].reshape(parts, rows, -1)).sum(0, dtype=torch.float32)
    if main < m:
        total += g[main:].t() @ x[main:]
    return total.to(g.dtype)


def split_parts(m: int, out_elements: int) -> int:
    """Parts a reduction over `m` rows into an output of `out_elements` is cut into: one per
    SPLIT_ROWS rows, or more for a small output (at 8K rows the router's fp32 gradient ran
    as 64 thread blocks of 4,096-long dot products: 150 us on an H100)."""
    wide = min(m // MIN_PART_ROWS, PARTIAL_ELEMENTS // max(1, out_elements))
    return max(m // SPLIT_ROWS, wide, 1)


class Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor) -> Tensor:
        ctx.save_for_backward(x, w)
        return products().column(x, w)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, Tensor | None]:
        x, w = ctx.saved_tensors
        g = g.to(w.dtype)
        gx = (g @ w).to(x.dtype) if ctx.needs_input_grad[0] else None
        gw = weight_grad(g, x.to(w.dtype)) if ctx.needs_input_grad[1] else None
        return gx, gw


class LinearTree(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, n_chunks: int) -> Tensor:
        ctx.save_for_backward(x, w)
        return products().row_tree(x, w, n_chunks)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        x, w = ctx.saved_tensors
        g = g.to(w.dtype)
        gx = (g @ w).to(x.dtype) if ctx.needs_input_grad[0] else None
        gw = weight_grad(g, x.to(w.dtype)) if ctx.needs_input_grad[1] else None
        return gx, gw, None


class SwiGLU(torch.autograd.Function):
    """Dense silu(x w1^T) * (x w3^T) (a shared expert, or a dense FFN)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w1: Tensor, w3: Tensor) -> Tensor:
        out, a13 = products().swiglu_and_product(x, w1, w3)
        ctx.save_for_backward(x, w1, w3, a13 if KEEP_SWIGLU_PRODUCT else None)
        return out

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        x, w1, w3, a13 = ctx.saved_tensors
        h = w1.shape[0]
        xw, w13 = x.to(w1.dtype), torch.cat([w1, w3])
        if a13 is None:  # one GEMM recomputes both halves
            a13 = xw @ w13.t()
        # one kernel gives both gradients, one GEMM each for the input and the stacked
        # weights
        d13 = silu_mul_bwd(a13, g.to(w1.dtype))
        g13 = weight_grad(d13, xw)
        return (d13 @ w13).to(x.dtype), g13[:h], g13[h:]


class GroupedSwiGLU(torch.autograd.Function):
    """Per expert e: silu(x_e w1[e]^T) * (x_e w3[e]^T); rows sorted by expert.

    `offsets` (E,) int32 on the device: the cumulative expert row counts; `empty` (E,)
    bool: the experts without rows. The backward is four grouped GEMMs
    (`torch._grouped_mm`) and one element-wise kernel over every expert at once: no expert
    count reaches the host."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        w1: Tensor,
        w3: Tensor,
        offsets: Tensor,
        tiles: tuple,
        empty: Tensor,
        w13: Tensor | None = None,
    ) -> Tensor:
        """`w13`: the experts' [w1; w3] (E, 2H, K) where the caller caches it (the same
        values, so the same bits; forward and backward then concatenate nothing)."""
        out, a13 = products().grouped_swiglu_and_product(x, w1, w3, offsets, tiles, w13)
        ctx.save_for_backward(x, w1, w3, offsets, empty, w13, a13 if KEEP_SWIGLU_PRODUCT else None)
        return out

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple:
        x, w1, w3, offsets, empty, w13, a13 = ctx.saved_tensors
        h = w1.shape[1]
        xw = x.to(w1.dtype)
        if w13 is None:
            w13 = torch.cat([w1, w3], dim=1)  # (E, 2H, K)
        if a13 is None:  # the forward's product, recomputed (`KEEP_SWIGLU_PRODUCT`)
            a13 = grouped_mm(xw, w13.transpose(1, 2), offsets)
        d13 = silu_mul_bwd(a13, g.to(w1.dtype))
        gx = grouped_mm(d13, w13, offsets)
        if SPLIT_EXPERT_GRADS:
            # w1's and w3's gradients as two contiguous products over d13's halves: slices of
            # one (E, 2H, K) product are strided, and accumulating a strided gradient into
            # `.grad` takes a generic element-wise kernel (H100: ~57 us a call at `large`)
            g1, g3 = (
                _empty_experts_zero(grouped_mm(d.t(), xw, offsets), empty)
                for d in (d13[:, :h], d13[:, h:])
            )
        else:
            g13 = _empty_experts_zero(grouped_mm(d13.t(), xw, offsets), empty)
            g1, g3 = g13[:, :h], g13[:, h:]
        return gx.to(x.dtype), g1, g3, None, None, None, None


class GroupedTree(torch.autograd.Function):
    """Per expert e: fp32 tree product h_e @ w2[e].T; rows sorted by expert (backward as
    `GroupedSwiGLU`'s: grouped GEMMs, offsets on the device)."""

    @staticmethod
    def forward(
        ctx: Any,
        h: Tensor,
        w2: Tensor,
        offsets: Tensor,
        tiles: tuple,
        n_chunks: int,
        empty: Tensor,
    ) -> Tensor:
        ctx.save_for_backward(h, w2, offsets, empty)
        return products().grouped_tree(h, w2, offsets, tiles, n_chunks)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple:
        h, w2, offsets, empty = ctx.saved_tensors
        gh, g2 = _tree_grads(g.to(w2.dtype), h, w2, offsets, empty)
        return gh, g2, None, None, None, None


def _tree_grads(
    gw: Tensor, h: Tensor, w2: Tensor, offsets: Tensor, empty: Tensor
) -> tuple[Tensor, Tensor]:
    """The experts' down projection's input and weight gradients from its output's gradient
    `gw` (rows sorted by expert) in the weights' dtype: two grouped GEMMs."""
    gh = grouped_mm(gw, w2, offsets)
    g2 = _empty_experts_zero(grouped_mm(gw.t(), h.to(w2.dtype), offsets), empty)
    return gh.to(h.dtype), g2


class TreeCombine(torch.autograd.Function):
    """The experts' down projection, the MoE's combine and the residual add as one node:
    h + (shared + sum_j gates[:, j] * y[pos[:, j]]) (N, d) fp32, y (N * k, d) = the experts'
    fp32 tree products of `hidden` (rows sorted by expert; `GroupedTree`'s forward), the
    combine as the inference kernel computes it (`moe_route.combine_fwd`, bitwise the
    unfused fold in slot order). `pos` (N, k): where the expert layout put each (token,
    slot) row, a permutation of y's rows.

    The backward is one combine kernel (`moe_bwd.combine_bwd`: the rows' and the gates'
    gradients) and the tree's two grouped GEMMs. The combine's kernel writes the rows'
    gradients in the weights' dtype: as two nodes (`GroupedTree`, then `Combine`) they
    were written in fp32 for the tree's backward to cast, an fp32 (N * k, d) write, its read
    and a cast kernel more per MoE layer (0.5 GB of traffic at `large`, 2 x 8K). The same
    gradients, bitwise: one round to nearest either way."""

    @staticmethod
    def forward(
        ctx: Any,
        h: Tensor,
        hidden: Tensor,
        w2: Tensor,
        offsets: Tensor,
        tiles: tuple,
        n_chunks: int,
        empty: Tensor,
        pos: Tensor,
        gates: Tensor,
        shared: Tensor | None,
    ) -> Tensor:
        from rlsys.kernels.triton_ops.moe_route import combine_fwd

        y = products().grouped_tree(hidden, w2, offsets, tiles, n_chunks)
        pos, gates = pos.contiguous(), gates.contiguous()  # read at unit stride (`Combine`)
        ctx.save_for_backward(hidden, w2, offsets, empty, y, pos, gates)
        ctx.has_shared = shared is not None
        return combine_fwd(h, y, pos, gates, shared)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple:
        from rlsys.kernels.triton_ops.moe_bwd import combine_bwd

        hidden, w2, offsets, empty, y, pos, gates = ctx.saved_tensors
        need_rows = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        gy, gg = combine_bwd(
            g.contiguous(), y, pos, gates, need_rows, ctx.needs_input_grad[8], w2.dtype
        )
        gh, g2 = _tree_grads(gy, hidden, w2, offsets, empty) if need_rows else (None, None)
        shared = g if ctx.has_shared else None
        return g, gh, g2, None, None, None, None, None, gg, shared


def _empty_experts_zero(grads: Tensor, empty: Tensor) -> Tensor:
    """Weight gradients (E, ., .) with an exact 0 for the `empty` experts (no rows): a
    grouped GEMM over an empty group reduces over nothing, and is not relied on to write
    zeros. In place, one launch that writes only the empty experts' slices."""
    from rlsys.kernels.triton_ops.expert_plan import zero_empty_experts

    return zero_empty_experts(grads, empty)


class SortedRows(torch.autograd.Function):
    """`x[order // k]`: each token's row once per routed slot, in expert order. The backward
    sums a token's k slot gradients in fp32 in slot order (a fixed reduction): indexing's
    backward would accumulate duplicates with atomics (an order that varies run to run)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, order: Tensor, inverse: Tensor, k: int) -> Tensor:
        ctx.save_for_backward(inverse)
        ctx.k = k
        return x.index_select(0, order // k)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple:
        from rlsys.kernels.triton_ops.moe_bwd import slot_sum

        (inverse,) = ctx.saved_tensors  # token-major: slot t * k + j is sorted row inverse[.]
        gx = slot_sum(g.contiguous(), inverse.view(-1, ctx.k))
        return gx, None, None, None


class RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, gamma: Tensor, eps: float) -> Tensor:
        ctx.save_for_backward(x, gamma)
        ctx.eps = eps
        return rows.rms_norm_fwd(x, gamma, eps)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, Tensor, None]:
        x, gamma = ctx.saved_tensors
        gx, gg = rms_norm_bwd(x, gamma, g, ctx.eps)
        return gx, gg, None


class RMSNormTo(torch.autograd.Function):
    """`rms_norm(x, gamma, eps).to(dtype)` as one node: the forward is the fused kernel's
    bits (`rows.rms_norm_fwd` rounds once to `dtype`, bitwise the cast of the fp32 norm),
    the backward reads the rounded output's gradient as it is (no cast kernel either way)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, gamma: Tensor, eps: float, dtype: torch.dtype) -> Tensor:
        ctx.save_for_backward(x, gamma)
        ctx.eps = eps
        return rows.rms_norm_fwd(x, gamma, eps, dtype)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, Tensor, None, None]:
        x, gamma = ctx.saved_tensors
        gx, gg = rms_norm_bwd(x, gamma, g, ctx.eps)
        return gx, gg, None, None


class AddRMSNormTo(torch.autograd.Function):
    """`h' = h + a.float()` and `rms_norm(h', gamma, eps).to(dtype)` as one node: forward
    the fused kernel (`rows.add_rms_norm_fwd`, bitwise the unfused expression), backward one
    kernel giving dh (the residual's gradient plus the norm's) and da (dh cast to a's
    dtype) (`norm_bwd.add_rms_norm_bwd`)."""

    @staticmethod
    def forward(
        ctx: Any, h: Tensor, a: Tensor, gamma: Tensor, eps: float, dtype: torch.dtype
    ) -> tuple[Tensor, Tensor]:
        h_new, y = rows.add_rms_norm_fwd(h, a, gamma, eps, dtype)
        ctx.save_for_backward(h_new, gamma)
        ctx.eps, ctx.a_dtype = eps, a.dtype
        return h_new, y

    @staticmethod
    def backward(ctx: Any, g_h: Tensor | None, g_y: Tensor | None) -> tuple:
        h_new, gamma = ctx.saved_tensors
        if g_y is None:  # only the sum was used: the add's gradient alone
            assert g_h is not None
            return g_h, g_h.to(ctx.a_dtype), None, None, None
        dh, da, gg = add_rms_norm_bwd(h_new, gamma, g_y, g_h, ctx.eps, ctx.a_dtype)
        return dh, da, gg, None, None


class LogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        out = rows.log_softmax_fwd(x)
        ctx.save_for_backward(out)
        ctx.in_dtype = x.dtype
        return out

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:
        (out,) = ctx.saved_tensors
        gx = g - torch.exp(out) * g.sum(-1, keepdim=True)
        return gx.to(ctx.in_dtype)


def in_order_fold(x: Tensor, dim: int) -> Tensor:
    """`x.sum(dim)` as the in-order fold `((x0 + x1) + x2) + ...` (`kernels.sequential_sum`)."""
    acc = x.select(dim, 0)
    for i in range(1, x.shape[dim]):
        acc = acc + x.select(dim, i)
    return acc


class SequentialSum(torch.autograd.Function):
    """The in-order fold as one autograd node: the forward is the fold's bits; the backward
    is the sum's gradient, `g` broadcast along `dim` (one op, not a select and an add per
    element of `dim`)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: int) -> Tensor:
        ctx.dim, ctx.shape = dim, x.shape
        return in_order_fold(x, dim)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
        return g.unsqueeze(ctx.dim).expand(ctx.shape), None


class RoutedGates(torch.autograd.Function):
    """`normalize_rows(scores.gather(-1, idx))` as one node: the forward is that expression's
    bits (the gather, the in-order fold, the division); the backward is its gradient in
    closed form, d sel = (g - sum_j g_j gates_j) / total, scattered into the scores' row
    (`scatter_add_`: idx is distinct within a row, so no two adds meet)."""

    @staticmethod
    def forward(ctx: Any, scores: Tensor, idx: Tensor) -> Tensor:
        sel = scores.gather(-1, idx)
        total = in_order_fold(sel, -1)
        gates = sel / total.unsqueeze(-1)
        ctx.save_for_backward(idx, gates, total)
        ctx.width = scores.shape[-1]
        return gates

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
        idx, gates, total = ctx.saved_tensors
        d_sel = (g - (g * gates).sum(-1, keepdim=True)) / total.unsqueeze(-1)
        out = d_sel.new_zeros(*idx.shape[:-1], ctx.width)
        return out.scatter_add_(-1, idx, d_sel), None


class Combine(torch.autograd.Function):
    """`h + (shared + sum_j gates[:, j] * y_sorted[pos[:, j]])` (N, d) fp32: the MoE's combine
    and residual add as the inference kernel computes them (`moe_route.combine_fwd`, bitwise
    the unfused fold in slot order), with a backward of one kernel (`moe_bwd.combine_bwd`;
    the per-slot fold's autograd graph is four nodes per slot). `pos` (N, k): where the
    expert layout put each (token, slot) row, a permutation of the rows of `y_sorted`
    (N * k, d) fp32."""

    @staticmethod
    def forward(
        ctx: Any, h: Tensor, y_sorted: Tensor, pos: Tensor, gates: Tensor, shared: Tensor | None
    ) -> Tensor:
        from rlsys.kernels.triton_ops.moe_route import combine_fwd

        # the kernel reads a row's k slots at unit stride (replayed gates may be a view)
        pos, gates = pos.contiguous(), gates.contiguous()
        ctx.save_for_backward(y_sorted, pos, gates)
        ctx.has_shared = shared is not None
        return combine_fwd(h, y_sorted, pos, gates, shared)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple:
        from rlsys.kernels.triton_ops.moe_bwd import combine_bwd

        y_sorted, pos, gates = ctx.saved_tensors
        # one pass: row pos[t, j] of y_sorted fed token t with weight gates[t, j], and
        # d out / d gates[t, j] = y_sorted[pos[t, j]]
        gy, gg = combine_bwd(
            g.contiguous(), y_sorted, pos, gates, ctx.needs_input_grad[1], ctx.needs_input_grad[3]
        )
        return g, gy, None, gg, (g if ctx.has_shared else None)
