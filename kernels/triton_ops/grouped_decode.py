"""The routed experts' products at decode sizes (w1;w3 with SwiGLU, and the down
projection's tree): one launch each, every expert's few rows, the weights streamed once.

At decode a batch of n tokens gives each of E experts about n * k / E rows (8 at batch 64
for `large`). The grouped GEMM (`torch._grouped_mm`) tiles M by 64 and the weights by 128
columns, reads each expert's [w1; w3] once, and then `silu_mul` runs as its own launch over
the bf16 product. Here one program owns (expert e, a BN-column slice of w1 and the same
slice of w3): it walks e's rows BR at a time and K in BK steps, with the weights as the
MMA's wide side (swap-AB: acc^T = W_tile @ X^T, so a handful of rows is the MMA's narrow
N, not a mostly-empty 64-row M), and applies SwiGLU in the epilogue.

Numerics: each output element is one in-order K loop of MMA steps into an fp32 accumulator
(`tl.dot` with the accumulator chained), rounded to the weight dtype, then
`a1 / (1 + exp(-a1)) * a3` in fp32 and rounded once: the grouped GEMM's and `silu_mul`'s
arithmetic. Whether the MMA here gives the grouped GEMM's bits is a property of the GPU
and its libraries, not of this code: `products` uses this kernel only where a check at
first use found them equal (`InvariantProducts.decode_swiglu`), and a GPU test compares
them at every preset's expert shape. The down projection (`grouped_tree_rows`) is the
grouped tree kernel's own `_tree` with the operands' roles swapped, behind the same kind
of check (`products.decode_tree_holds`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from rlsys.kernels.triton_ops import linear as lin
from rlsys.kernels.triton_ops import pdl
from rlsys.kernels.triton_ops.common import check_device, dot_precision, interpreting, mma
from rlsys.kernels.triton_ops.linear import _tree

BN = 64  # weight rows (output columns) per program
BK = 64  # K step
BR = 16  # token rows per MMA (the MMA's narrow side; 16 is its least)
LAUNCH = {"num_warps": 4, "num_stages": 4}  # both kernels (one warpgroup: wgmma on sm_90)
# Routed rows up to which these kernels run instead of the grouped GEMM / grouped tree: a
# speed choice (the bits are the same), from benchmarks/bench_moe_decode.py on the H200.
DECODE_ROWS = 1024


# rows per expert in the checks that admit these kernels (`products`) and in their tests:
# none, one, one MMA's worth, one past it, a few, more than two MMAs' worth
CHECK_ROWS = (0, 1, BR, BR + 1, 3, 2 * BR + 5)


def check_counts(n_experts: int) -> Tensor:
    """Rows per expert for a check of `n_experts` experts: `CHECK_ROWS`, cycled."""
    return torch.tensor([CHECK_ROWS[i % len(CHECK_ROWS)] for i in range(n_experts)])


def decode_sized(rows: int) -> bool:
    """Whether `rows` routed rows (tokens x experts per token) take the decode kernels."""
    return rows <= DECODE_ROWS


@triton.jit
def _dot_acc(w, xt, acc, UPCAST: tl.constexpr):
    """acc + w @ xt, the accumulator chained through the MMA (fp32, in-order K)."""
    if UPCAST:  # the interpreter's form (`common.mma`)
        return acc + mma(w, xt, "ieee", UPCAST)
    return tl.dot(w, xt, acc)


@triton.jit
def _grouped_swiglu_rows(
    X, ORDER, W, OFFS, Y, K, H, sx, sw_e, sw_n, sy,
    SLOTS: tl.constexpr, GATHER: tl.constexpr,
    BN: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, UPCAST: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """GATHER: sorted row r reads token row ORDER[r] // SLOTS of X (the routing's
    expert-sorted order; `moe_route.gather_rows`'s copy, read in place)."""
    pdl.wait_prior(PDL)
    pdl.release_next(PDL)
    e = tl.program_id(0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    end = tl.load(OFFS + e)
    start = tl.load(OFFS + e - 1, mask=e > 0, other=0)
    w_e = W + e.to(tl.int64) * sw_e
    w1_rows = w_e + n[:, None] * sw_n
    w3_rows = w_e + (H + n)[:, None] * sw_n
    kk = tl.arange(0, BK)
    for r0 in range(start, end, BR):
        r = r0 + tl.arange(0, BR)
        r_mask = r < end
        if GATHER:
            src = tl.load(ORDER + r, mask=r_mask, other=0) // SLOTS
        else:
            src = r
        x_cols = X + src.to(tl.int64)[None, :] * sx
        acc1 = tl.zeros([BN, BR], tl.float32)
        acc3 = tl.zeros([BN, BR], tl.float32)
        for k0 in range(0, K, BK):
            k = k0 + kk
            xt = tl.load(x_cols + k[:, None], mask=r_mask[None, :], other=0.0)
            w1 = tl.load(w1_rows + k[None, :])
            w3 = tl.load(w3_rows + k[None, :])
            acc1 = _dot_acc(w1, xt, acc1, UPCAST)
            acc3 = _dot_acc(w3, xt, acc3, UPCAST)
        a1 = acc1.to(Y.dtype.element_ty).to(tl.float32)
        a3 = acc3.to(Y.dtype.element_ty).to(tl.float32)
        y = a1 / (1.0 + tl.exp(-a1)) * a3
        out = Y + r.to(tl.int64)[None, :] * sy + n[:, None]
        tl.store(out, y.to(Y.dtype.element_ty), mask=r_mask[None, :])


@triton.jit
def _grouped_tree_rows(
    Hs, W, OFFS, Y, K, N, sh, sw_e, sw_n, sy,
    NCH: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr,
    EVEN: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """Y[rows of e] = the NCH-chunk fp32 tree of h @ w2[e]^T, computed transposed by
    `linear._tree` itself (the weight tile as its "x", the rows as its "w"): the same BK
    steps, chunk products and tree order as the grouped tree kernel's."""
    pdl.wait_prior(PDL)
    pdl.release_next(PDL)
    e = tl.program_id(0)
    n0 = tl.program_id(1) * BN
    end = tl.load(OFFS + e)
    start = tl.load(OFFS + e - 1, mask=e > 0, other=0)
    rn = tl.arange(0, BN)
    n_mask = n0 + rn < N
    w_tile = W + e.to(tl.int64) * sw_e + n0.to(tl.int64) * sw_n
    rr = tl.arange(0, BR)
    for r0 in range(start, end, BR):
        r_mask = r0 + rr < end
        acc = _tree(w_tile, Hs + r0 * sh, rn, rr, n_mask, r_mask, K,
                        sw_n, 1, sh, 1, NCH, BN, BR, BK, EVEN, UPCAST, PRECISION)  # fmt: skip
        out = Y + (r0 + rr).to(tl.int64)[None, :] * sy + (n0 + rn)[:, None]
        tl.store(out, acc, mask=n_mask[:, None] & r_mask[None, :])


def fits(w13: Tensor) -> bool:
    """Whether the kernel's fixed tiles cover this expert shape (E, 2H, K)."""
    _e, h2, k = w13.shape
    return h2 % (2 * BN) == 0 and k % BK == 0 and w13.stride(-1) == 1


def grouped_swiglu_rows(
    x: Tensor, w13: Tensor, offsets: Tensor, order: Tensor | None = None, slots: int = 1
) -> Tensor:
    """silu(x w1[e]^T) * (x w3[e]^T) -> (rows, H) in w13's dtype, for rows sorted by
    expert: w13 (E, 2H, K) = every expert's [w1; w3]; offsets (E,) int32, the cumulative row
    counts (expert e's rows end at offsets[e]), on the device (no host sync). `order`: x
    holds the tokens and sorted row r is token order[r] // `slots` (the routing's layout,
    `moe_route.expert_layout`): the gather is read in place, one launch fewer; else x
    holds the sorted rows themselves."""
    check_device(x, w13, offsets)
    n_exp, h2, k = w13.shape
    assert fits(w13), f"expert shape {tuple(w13.shape)} is off the kernel's tiles"
    assert x.shape[1] == k and x.stride(1) == 1
    h = h2 // 2
    rows = order.shape[0] if order is not None else x.shape[0]
    out = torch.empty(rows, h, dtype=w13.dtype, device=x.device)
    if rows:
        _grouped_swiglu_rows[(n_exp, h // BN)](
            x, order if order is not None else offsets, w13, offsets, out, k, h,
            x.stride(0), w13.stride(0), w13.stride(1), out.stride(0),
            SLOTS=slots, GATHER=order is not None,
            BN=BN, BK=BK, BR=BR, UPCAST=interpreting(), **LAUNCH, **pdl.launch(x.device),
        )  # fmt: skip
    return out


def grouped_tree_rows(h_sorted: Tensor, w2: Tensor, offsets: Tensor, n_chunks: int) -> Tensor:
    """Per expert, the fp32 `n_chunks`-chunk tree product h @ w2[e]^T -> (rows, N): the
    values `linear.grouped_tree_fwd` stores (its BK, its chunk products, its tree), one
    program per (expert, BN columns) walking that expert's rows."""
    check_device(h_sorted, w2, offsets)
    n_exp, n, k = w2.shape
    assert k % n_chunks == 0 and h_sorted.shape[1] == k and h_sorted.stride(1) == 1
    assert w2.stride(-1) == 1
    out = torch.empty(h_sorted.shape[0], n, dtype=torch.float32, device=h_sorted.device)
    if h_sorted.shape[0]:
        bk = lin.chunk_step(k // n_chunks, lin.tile_for(n, k, w2.dtype).bk)
        _grouped_tree_rows[(n_exp, triton.cdiv(n, BN))](
            h_sorted, w2, offsets, out, k, n,
            h_sorted.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
            NCH=n_chunks, BN=BN, BK=bk, BR=BR, EVEN=(k // n_chunks) % bk == 0,
            UPCAST=interpreting(), PRECISION=dot_precision(w2.dtype), **LAUNCH,
            **pdl.launch(h_sorted.device),
        )  # fmt: skip
    return out
