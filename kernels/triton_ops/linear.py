"""Batch-invariant matrix products: `x @ w.T`, its fixed 8-chunk tree form, and the grouped
(per-expert) versions the MoE runs.

Why not cuBLAS: it picks an algorithm (tile, split-K) from the shape, so a token's output
row changes with the number of rows in the batch. Here one program computes one
(BM x BN) output tile with ONE configuration for every M, reducing K as a fixed tree of
NCH chunks, each chunk in BK steps in ascending order; an output row therefore depends on
its input row and the weights only.
- `linear`: out = x @ w.T, fp32 accumulation, stored in `out_dtype` (w's by default); NCH
  from K alone (`column_chunks`).
- `linear_tree`: the row-parallel form of `rlsys.kernels.tp`: K is cut into NCH equal
  chunks whose fp32 partial products are summed as the balanced tree
  ((p0 + p1) + (p2 + p3)) + ..., so a TP rank owning a subtree of chunks computes that
  subtree's value bitwise (fp32 out).
- Grouped variants take rows sorted by expert and a tile table (tile -> expert, first row,
  rows): w is (E, N, K); one launch for all experts, no Python loop over experts.
Two schedules compute the same bits (a speed choice, which may depend on M): `serial`, one
program per output tile adds its chunks in registers (prefill, training); `split`, one
program per (tile, chunk) stores fp32 chunk products and `_tree_reduce` adds them in the
same tree order (decode: a 64-row batch against a 1K x 1K weight is 16 tiles, an eighth of
the GPU, each walking K serially; split, it is 128 programs of two BK steps each).
Backward passes (training) use plain torch matmuls: training needs no batch invariance.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from rlsys.kernels.triton_ops import pdl
from rlsys.kernels.triton_ops.common import check_device, dot_precision, interpreting, mma
from rlsys.kernels.triton_ops.expert_plan import expert_plan

BM = 64  # rows per tile: fixed for every M (the grouped tile table uses it too)


@dataclass(frozen=True)
class TileConfig:
    """One launch configuration. Chosen from the weight's shape only, never from M: a
    row's reduction (BK steps in order, one MMA shape) must not change with the batch."""

    bn: int = 64
    bk: int = 64
    warps: int = 4
    stages: int = 3
    bm: int = 64  # rows per tile of a dense product; grouped products keep `BM` (tile tables)

    def __post_init__(self) -> None:
        for name in ("bm", "bn", "bk"):  # `tl.dot` takes powers of two from 16
            size = getattr(self, name)
            if size < 16 or size & (size - 1):
                raise ValueError(f"TileConfig.{name}={size}: must be a power of two >= 16")

    def rows_per_tile(self, grouped: bool) -> int:
        return BM if grouped else self.bm


DEFAULT_TILE = TileConfig()
# The serial fp32 trees may keep their left half in the output while the right half is
# summed (`_tree_halved`: the same bits, one register tile fewer). Off: on the H100
# (thirty-fifth session, `bench_tree_tiles.py --halved both`) it was slower at every tile
# (`large`'s dense tree at 16K rows 232 -> 259 us, the grouped one even) and the trainer did
# not move (30,961 / 30,570 -> 30,855 / 30,399 tok/s). `RLSYS_HALVED_TREES=1`, a
# benchmark's switch.
HALVED_TREES = os.environ.get("RLSYS_HALVED_TREES", "0") == "1"
# The trees' chunk-major form (one accumulator per chunk, each a pure MMA chain, the folds
# after the loop: the same bits, MMA waits of 8 against 0 offline) was built and timed on
# the H100 (thirty-sixth session, `bench_tree_tiles.py`): slower at every tile it fits
# (dense 16K rows 318 -> 382 us at 32 x 64 on 4 warps, against 241 for the default tile),
# and out of shared memory at every 64-wide tile (8 operand tiles a stage). Removed.
TILES: dict[tuple[int, int], TileConfig] = {}  # (N, K) -> measured best (benchmarks/)
# fp32 weights (exact `tl.dot`, FMA rather than tensor cores): the routers of the bf16
# presets, (n_experts, d_model). `benchmarks/bench_router_product.py` times candidates; a
# shape gets an entry only once a tile has been timed faster on the GPU.
# (32, 1024), `large`'s router, on the H100 (twenty-ninth session; one launch's share of a
# CUDA graph, the decode path `partial_products`): 14.2 -> 4.6 us at 64 rows and 1 row
# against the 64 x 64 tile (which wastes half its columns on 32 experts, in 8 programs),
# bitwise the same product. Offline (sm_90) the serial schedule takes 88 registers and no
# spill, where the 64 x 64 tile took 255 and spilled (compiles that kept the unit strides
# as runtime values; as launched, the split schedule's programs take 72 and 128 registers,
# neither spilling: thirty-fifth session. The timing stands.)
FP32_TILES: dict[tuple[int, int], TileConfig] = {
    (32, 1024): TileConfig(bn=16, bk=64, warps=1, stages=3, bm=16),
}


def tile_for(n: int, k: int, dtype: torch.dtype | None = None) -> TileConfig:
    """The launch configuration of a product with an (N, K) weight of `dtype`: from the
    weight alone, so the engine and the trainer (and every batch size) reduce alike."""
    if dtype == torch.float32 and (n, k) in FP32_TILES:
        return FP32_TILES[(n, k)]
    return TILES.get((n, k), DEFAULT_TILE)


@triton.jit
def _step(
    acc, x_ptr, w_ptr, rm, rn, m_mask, n_mask, k0, kk, k_len,
    sx_m, sx_k, sw_n, sw_k,
    BK: tl.constexpr, EVEN: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """acc + x[rm, k] @ w[rn, k].T for k in [k0 + kk, k0 + kk + BK) within [k0, k0 + k_len).

    x_ptr / w_ptr point at the tile's first row / column (int64 arithmetic once per tile);
    rm / rn are tile-local int32 indices: full-tile int64 pointer tensors cost registers
    (the 8-chunk tree spilled: BENCHMARKS, "The batch-invariant linear split over K").
    EVEN: BK divides the chunk, so no K mask, and the offset is declared a multiple of BK:
    without that the compiler cannot prove the loads aligned, does not vectorise them and
    does not pipeline the loop (seen in the TTGIR: no async copies)."""
    rk = tl.arange(0, BK)
    if EVEN:
        k = tl.multiple_of(k0 + kk, BK) + rk
        a_mask = m_mask[:, None]
        b_mask = n_mask[:, None]
    else:
        k = k0 + kk + rk
        k_mask = (kk + rk) < k_len
        a_mask = m_mask[:, None] & k_mask[None, :]
        b_mask = n_mask[:, None] & k_mask[None, :]
    a = tl.load(x_ptr + (rm[:, None] * sx_m + k[None, :] * sx_k), mask=a_mask, other=0.0)
    b = tl.load(w_ptr + (rn[:, None] * sw_n + k[None, :] * sw_k), mask=b_mask, other=0.0)
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    else:
        a = a.to(b.dtype)
    return acc + mma(a, tl.trans(b), PRECISION, UPCAST)


@triton.jit
def _chunk_acc(
    x_ptr, w_ptr, rm, rn, m_mask, n_mask, k0, k_len,
    sx_m, sx_k, sw_n, sw_k,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """fp32 (BM, BN) sum over k in [k0, k0 + k_len) of x[rm, k] * w[rn, k], BK at a time."""
    acc = tl.zeros([BM, BN], tl.float32)
    for kk in range(0, k_len, BK):
        acc = _step(acc, x_ptr, w_ptr, rm, rn, m_mask, n_mask, k0, kk, k_len, sx_m, sx_k,
                    sw_n, sw_k, BK, EVEN, UPCAST, PRECISION)  # fmt: skip
    return acc


@triton.jit
def _tree(
    x_ptr, w_ptr, rm, rn, m_mask, n_mask, K,
    sx_m, sx_k, sw_n, sw_k,
    NCH: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    EVEN: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """The balanced-tree sum ((p0 + p1) + (p2 + p3)) + ... of NCH chunk products (NCH in 1,
    2, 4, 8) in one program: ONE loop over every BK step of every chunk (so the loads stay
    pipelined across chunk ends), each chunk's product folded into the pending subtree sums
    s1, s2, s4 (a binary counter) when its last step is done. `_tree_reduce` is the same
    tree over chunk products computed by separate programs (`_chunk_acc`, the same steps);
    the two must add in the same order (tests/kernels/test_linear_schedules.py)."""
    size = K // NCH
    per_chunk = tl.cdiv(size, BK)
    acc = tl.zeros([BM, BN], tl.float32)
    s1 = tl.zeros([BM, BN], tl.float32)
    s2 = tl.zeros([BM, BN], tl.float32)
    s4 = tl.zeros([BM, BN], tl.float32)
    for i in range(0, NCH * per_chunk):
        c = i // per_chunk
        acc = _step(acc, x_ptr, w_ptr, rm, rn, m_mask, n_mask, c * size, (i - c * per_chunk) * BK,
                    size, sx_m, sx_k, sw_n, sw_k, BK, EVEN, UPCAST, PRECISION)  # fmt: skip
        if NCH > 1:
            if (i + 1) % per_chunk == 0:  # chunk c's product is acc
                if c % 2 == 0:
                    s1 = acc
                elif NCH == 2:
                    s1 = s1 + acc  # the whole tree
                elif c % 4 == 1:
                    s2 = s1 + acc
                elif NCH == 4:
                    s2 = s2 + (s1 + acc)  # the whole tree
                elif c % 8 == 3:
                    s4 = s2 + (s1 + acc)
                else:
                    s4 = s4 + (s2 + (s1 + acc))  # c = 7: the whole tree
                acc = tl.zeros([BM, BN], tl.float32)
    if NCH == 1:
        return acc
    elif NCH == 2:
        return s1
    elif NCH == 4:
        return s2
    else:
        return s4


@triton.jit
def _tree_halved(
    x_ptr, w_ptr, rm, rn, m_mask, n_mask, K,
    sx_m, sx_k, sw_n, sw_k, y_ptrs, y_mask,
    NCH: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    EVEN: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """`_tree`'s sum (NCH in 2, 4, 8), bitwise, stored at `y_ptrs` (fp32) by this function:
    the left half's subtree (chunks [0, NCH / 2)) is stored there as soon as it is complete
    and loaded back for the root's one addition, so the loop carries one fp32 tile fewer
    (acc, s1, s2 at NCH = 8 where `_tree` carries acc, s1, s2, s4: 32 registers a thread
    fewer at a 64 x 64 tile on 4 warps, 224 as launched, no spill). The same additions in
    the same order as `_tree`: left = ((p0 + p1) + (p2 + p3)), right = ((p4 + p5) +
    (p6 + p7)), left + right."""
    size = K // NCH
    per_chunk = tl.cdiv(size, BK)
    acc = tl.zeros([BM, BN], tl.float32)
    s1 = tl.zeros([BM, BN], tl.float32)
    s2 = tl.zeros([BM, BN], tl.float32)
    for i in range(0, NCH * per_chunk):
        c = i // per_chunk
        acc = _step(acc, x_ptr, w_ptr, rm, rn, m_mask, n_mask, c * size, (i - c * per_chunk) * BK,
                    size, sx_m, sx_k, sw_n, sw_k, BK, EVEN, UPCAST, PRECISION)  # fmt: skip
        if (i + 1) % per_chunk == 0:  # chunk c's product is acc
            if NCH == 2:
                if c == 0:
                    tl.store(y_ptrs, acc, mask=y_mask)  # the left half: p0
                else:
                    s1 = acc  # the right half: p1
            elif NCH == 4:
                if c % 2 == 0:
                    s1 = acc
                elif c == 1:
                    tl.store(y_ptrs, s1 + acc, mask=y_mask)  # the left half
                else:
                    s1 = s1 + acc  # the right half
            else:
                if c % 2 == 0:
                    s1 = acc
                elif c % 4 == 1:
                    s2 = s1 + acc
                elif c == 3:
                    tl.store(y_ptrs, s2 + (s1 + acc), mask=y_mask)  # the left half
                else:
                    s2 = s2 + (s1 + acc)  # the right half
            acc = tl.zeros([BM, BN], tl.float32)
    # the left half was stored by other threads of this program (the store's and the load's
    # layouts need not map an element to one thread): a barrier makes it visible
    tl.debug_barrier()
    left = tl.load(y_ptrs, mask=y_mask, other=0.0)
    if NCH == 8:
        total = left + s2
    else:
        total = left + s1
    tl.store(y_ptrs, total, mask=y_mask)


@triton.jit
def _matmul(
    X, W, W3, Y, P, M, N, K, MN,
    sx_m, sx_k, sw_e, sw_n, sw_k, sy_m, sy_n,
    tile_expert, tile_row0, tile_rows,
    NCH: tl.constexpr, GROUPED: tl.constexpr, SWIGLU: tl.constexpr, SPLIT: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr = False,
    HALVED: tl.constexpr = False,
):  # fmt: skip
    """One (BM x BN) output tile. Serial (SPLIT false): the whole NCH-chunk tree, stored in
    Y's dtype (HALVED: an fp32 Y, NCH > 1, no SWIGLU; `_tree_halved` keeps the left half
    there). Split: program_id(2) = chunk c computes chunk c's fp32 product alone and
    stores it at P[c] (P[NCH + c] for w3's under SWIGLU); `_tree_reduce` adds them."""
    pdl.wait_prior(PDL)
    pdl.release_next(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if GROUPED:
        e = tl.load(tile_expert + pid_m)
        row0 = tl.load(tile_row0 + pid_m)
        rows = tl.load(tile_rows + pid_m)
        w_ptr = W + e.to(tl.int64) * sw_e
        w3_ptr = W3 + e.to(tl.int64) * sw_e
    else:
        row0 = pid_m * BM
        rows = M - row0
        w_ptr = W
        w3_ptr = W3
    rm = tl.arange(0, BM)  # tile-local rows and columns (see `_step`)
    rn = tl.arange(0, BN)
    m_mask = rm < rows
    n_mask = pid_n * BN + rn < N
    x_tile = X + row0.to(tl.int64) * sx_m
    w_tile = w_ptr + (pid_n * BN).to(tl.int64) * sw_n
    w3_tile = w3_ptr + (pid_n * BN).to(tl.int64) * sw_n
    mask = m_mask[:, None] & n_mask[None, :]
    K = tl.where(rows > 0, K, 0)  # surplus grouped tiles skip the K loop
    if SPLIT:
        c = tl.program_id(2)
        size = K // NCH
        at = row0.to(tl.int64) * N + pid_n * BN + (rm[:, None] * N + rn[None, :])
        p = _chunk_acc(x_tile, w_tile, rm, rn, m_mask, n_mask, c * size, size, sx_m, sx_k, sw_n, sw_k,
                       BM, BN, BK, EVEN, UPCAST, PRECISION)  # fmt: skip
        tl.store(P + c.to(tl.int64) * MN + at, p, mask=mask)
        if SWIGLU:
            p3 = _chunk_acc(x_tile, w3_tile, rm, rn, m_mask, n_mask, c * size, size, sx_m, sx_k, sw_n,
                            sw_k, BM, BN, BK, EVEN, UPCAST, PRECISION)  # fmt: skip
            tl.store(P + (NCH + c).to(tl.int64) * MN + at, p3, mask=mask)
    elif HALVED:
        y_tile = Y + row0.to(tl.int64) * sy_m + (pid_n * BN).to(tl.int64) * sy_n
        _tree_halved(x_tile, w_tile, rm, rn, m_mask, n_mask, K, sx_m, sx_k, sw_n, sw_k,
                     y_tile + (rm[:, None] * sy_m + rn[None, :] * sy_n), mask,
                     NCH, BM, BN, BK, EVEN, UPCAST, PRECISION)  # fmt: skip
    else:
        acc = _tree(x_tile, w_tile, rm, rn, m_mask, n_mask, K, sx_m, sx_k, sw_n, sw_k,
                    NCH, BM, BN, BK, EVEN, UPCAST, PRECISION)  # fmt: skip
        if SWIGLU:
            # silu(x w1^T) * (x w3^T) from the fp32 accumulators, rounded once
            a3 = _tree(x_tile, w3_tile, rm, rn, m_mask, n_mask, K, sx_m, sx_k, sw_n, sw_k,
                       NCH, BM, BN, BK, EVEN, UPCAST, PRECISION)  # fmt: skip
            acc = _swiglu(acc, a3)
        y_tile = Y + row0.to(tl.int64) * sy_m + (pid_n * BN).to(tl.int64) * sy_n
        tl.store(y_tile + (rm[:, None] * sy_m + rn[None, :] * sy_n), acc.to(Y.dtype.element_ty),
                 mask=mask)  # fmt: skip


@triton.jit
def _swiglu(a1, a3):
    return a1 / (1.0 + tl.exp(-a1)) * a3


@triton.jit
def _tree_of(P, at, mn, mask, NCH: tl.constexpr):
    """`_tree`'s balanced sum over the NCH chunk products stored at P[c * mn + at]."""
    p0 = tl.load(P + at, mask=mask, other=0.0)
    if NCH >= 2:
        p0 = p0 + tl.load(P + mn + at, mask=mask, other=0.0)
    if NCH >= 4:
        p2 = tl.load(P + 2 * mn + at, mask=mask, other=0.0)
        p3 = tl.load(P + 3 * mn + at, mask=mask, other=0.0)
        p0 = p0 + (p2 + p3)
    if NCH >= 8:
        p4 = tl.load(P + 4 * mn + at, mask=mask, other=0.0)
        p5 = tl.load(P + 5 * mn + at, mask=mask, other=0.0)
        p6 = tl.load(P + 6 * mn + at, mask=mask, other=0.0)
        p7 = tl.load(P + 7 * mn + at, mask=mask, other=0.0)
        p0 = p0 + ((p4 + p5) + (p6 + p7))
    return p0


@triton.jit
def _tree_reduce(
    P, Y, MN, N, sy_m, sy_n,
    NCH: tl.constexpr, SWIGLU: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """Y = the tree of the split programs' chunk products (then SwiGLU), element-wise."""
    pdl.wait_prior(PDL)
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < MN
    acc = _tree_of(P, idx, MN, mask, NCH)
    if SWIGLU:
        acc = _swiglu(acc, _tree_of(P + NCH * MN, idx, MN, mask, NCH))
    pdl.release_next(PDL)
    row, col = idx // N, idx % N
    tl.store(Y + row * sy_m + col * sy_n, acc.to(Y.dtype.element_ty), mask=mask)


SCHEDULES = ("auto", "serial", "split")
REDUCE_BLOCK = 1024


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter: pretend to be an H200 (the schedule is a speed choice)
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_chosen(tiles: int, nch: int, device: torch.device, schedule: str = "auto") -> bool:
    """Whether the chunks of the tree run as programs of their own.

    A speed choice that may depend on M (both schedules give the same bits): split when
    the output tiles alone would not fill one wave of the GPU (decode batches), serial
    otherwise (the partial products would cost a round trip through memory for nothing).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"linear schedule {schedule!r}: expected one of {SCHEDULES}")
    if nch == 1 or schedule == "serial":
        return False
    return schedule == "split" or tiles < _sm_count(device)


def _launch(
    x: Tensor,
    w: Tensor,
    w3: Tensor | None,
    out: Tensor,
    n: int,
    nch: int,
    tiles: tuple[Tensor, Tensor, Tensor] | None,
    swiglu: bool,
    cfg: TileConfig | None = None,
    schedule: str = "auto",
) -> Tensor:
    check_device(x, w)
    k_dim = x.shape[1]
    cfg = cfg or tile_for(n, k_dim, w.dtype)
    m, k = x.shape
    assert k % nch == 0
    if m == 0:
        return out
    grouped = tiles is not None
    if grouped:
        te, tr, tn = tiles
        grid_m = te.shape[0]
        sw_e, sw_n, sw_k = w.stride()
        assert w3 is None or w3.stride() == w.stride()
    else:
        te = tr = tn = x  # unused
        grid_m = triton.cdiv(m, cfg.bm)
        sw_e, (sw_n, sw_k) = 0, w.stride()
    grid_n = triton.cdiv(n, cfg.bn)
    split = split_chosen(grid_m * grid_n, nch, x.device, schedule)
    bk = chunk_step(k // nch, cfg.bk)
    # chunk products, (NCH [x2 for w3], M, N) fp32: only at decode-sized M
    parts = torch.empty((2 if swiglu else 1) * nch * m * n if split else 1, dtype=torch.float32,
                        device=x.device)  # fmt: skip
    _matmul[(grid_m, grid_n, nch if split else 1)](
        x, w, w3 if w3 is not None else w, out, parts, m, n, k, m * n,
        x.stride(0), x.stride(1), sw_e, sw_n, sw_k, out.stride(0), out.stride(1),
        te, tr, tn,
        NCH=nch, GROUPED=grouped, SWIGLU=swiglu, SPLIT=split, BM=cfg.rows_per_tile(grouped),
        BN=cfg.bn, BK=bk,
        HALVED=HALVED_TREES and nch > 1 and not swiglu and out.dtype == torch.float32,
        EVEN=(k // nch) % bk == 0,
        UPCAST=interpreting(), PRECISION=dot_precision(w.dtype),
        num_warps=cfg.warps, num_stages=cfg.stages, **pdl.launch(x.device),
    )  # fmt: skip
    if split:
        _tree_reduce[(triton.cdiv(m * n, REDUCE_BLOCK),)](
            parts, out, m * n, n, out.stride(0), out.stride(1),
            NCH=nch, SWIGLU=swiglu, BLOCK=REDUCE_BLOCK, **pdl.launch(x.device),
        )  # fmt: skip
    return out


def chunk_step(size: int, bk: int) -> int:
    """The K step for chunks of `size`: the tile's BK, halved (down to 16, the MMA's K)
    until it divides the chunk, so that most chunks need no K mask (`_step`'s EVEN).
    From K and the tree width only, never M."""
    while bk > 16 and size % bk:
        bk //= 2
    return bk


def column_chunks(k: int) -> int:
    """The tree width of a column (non-row-parallel) product: from K alone, so that a
    column-parallel shard (same K) and every batch size reduce alike. Chunks of at least
    two BK steps; 8 at most, like the row-parallel split."""
    nch = 8
    while nch > 1 and (k % nch or k // nch < 2 * DEFAULT_TILE.bk):
        nch //= 2
    return nch


def linear_fwd(
    x: Tensor,
    w: Tensor,
    out_dtype: torch.dtype | None = None,
    cfg: TileConfig | None = None,
    schedule: str = "auto",
) -> Tensor:
    """x (M, K) @ w (N, K).T -> (M, N) in `out_dtype` (default w's): the tree of
    `column_chunks(K)` chunk products."""
    out = torch.empty(x.shape[0], w.shape[0], dtype=out_dtype or w.dtype, device=x.device)
    nch = column_chunks(x.shape[1])
    return _launch(x, w, None, out, w.shape[0], nch, None, False, cfg, schedule)


def linear_tree_fwd(x: Tensor, w: Tensor, n_chunks: int, schedule: str = "auto") -> Tensor:
    """fp32 balanced-tree sum of `n_chunks` K-chunk products of x @ w.T."""
    out = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32, device=x.device)
    return _launch(x, w, None, out, w.shape[0], n_chunks, None, False, schedule=schedule)


def expert_tiles(counts: Tensor, max_tiles: int) -> tuple[Tensor, Tensor, Tensor]:
    """Tile table for rows sorted by expert: per tile (expert, first row, rows in tile).

    `max_tiles` >= cdiv(total, BM) + E bounds the grid without reading counts on the host
    (no device sync); surplus tiles get 0 rows and write nothing. One launch
    (`expert_plan`, which also gives the offsets and the experts without rows).
    """
    return expert_plan(counts, max_tiles, BM)[0]


def swiglu_fwd(
    x: Tensor,
    w1: Tensor,
    w3: Tensor,
    tiles: tuple[Tensor, Tensor, Tensor] | None = None,
    schedule: str = "auto",
) -> Tensor:
    """silu(x w1^T) * (x w3^T) -> (rows, H) in w's dtype; w1/w3 (H, K), or (E, H, K) with
    `tiles` for rows sorted by expert. Both products are `column_chunks(K)` trees."""
    h = w1.shape[-2]
    out = torch.empty(x.shape[0], h, dtype=w1.dtype, device=x.device)
    nch = column_chunks(x.shape[1])
    return _launch(x, w1, w3, out, h, nch, tiles, True, schedule=schedule)


def grouped_tree_fwd(
    h_sorted: Tensor,
    w2: Tensor,
    tiles: tuple[Tensor, Tensor, Tensor],
    n_chunks: int,
    schedule: str = "auto",
) -> Tensor:
    """Per expert fp32 tree product h @ w2[e].T; w2 (E, N, K)."""
    out = torch.empty(h_sorted.shape[0], w2.shape[1], dtype=torch.float32, device=h_sorted.device)
    return _launch(h_sorted, w2, None, out, w2.shape[1], n_chunks, tiles, False, schedule=schedule)
