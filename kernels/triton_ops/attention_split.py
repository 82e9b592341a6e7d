"""The forward attention walked chunk by chunk in parallel, then merged (split-KV decode).

A decode step has one query row per tile: one program per (tile, KV group) walks the
row's whole context alone (4,096 keys per Sparse GQA layer at 4K context, in 256 steps),
so a batch of one keeps a handful of SMs busy. Here:
- `_attn_fwd_part`, one program per (tile, KV group, softmax chunk), walks only the steps
  of its chunk, from the empty state, exactly as `attention_fwd._attn_fwd` walks them
  (`fold_step`), and stores the chunk's (m, denom, acc) in fp32 for the present rows;
- `_attn_merge`, one program per (tile, KV group), merges the chunks in ascending order
  (`merge_state`) and finishes the rows (`finish_rows`).
Invariant: the output and LSE are bitwise `_attn_fwd`'s. That kernel restarts its softmax
at the same chunk boundaries and merges with the same function; chunks it never visits
(no step of its walk falls there) are empty here, and an empty chunk merges as the
identity, bitwise (`merge_state`). Chunks follow `attention_fwd`'s boundary rule
(`chunk_of`): Sparse GQA's program j takes absolute chunk j, SWA's the j-th chunk from the
one its walk starts in. When every tile of the call holds one query (a plain decode step;
`ONE_ROW`, known on the host), the walk finds each step's mask once per key and broadcasts
it over the rows (`one_row_visibility`): the same mask, so the same bits (-10% time on the
H200). And with enough programs (`one_query_slots`) it runs only the 16 rows of the tile
that one of the single walk's 4 warps owns, the 16 // G slots holding the query
(`tile_rows`' SUB), on one warp: mma.sync there, wgmma in the whole tile, and the same
bits (the GPU tests), in a quarter of the warps' instructions. The merge is elementwise
per row, so it takes the same slice.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from rlsys.kernels.attention_plan import PagedKV, QueryTiles
from rlsys.kernels.triton_ops import pdl
from rlsys.kernels.triton_ops.attention_fwd import (
    LOG2E,
    NEG_INIT,
    chunk_constants,
    finish_rows,
    fold_step,
    forward_launch,
    fresh_state,
    load_queries,
    merge_state,
    one_query_slots,
    query_tile,
    step_positions,
    step_scores,
    tile_rows,
    visible_step,
)
from rlsys.kernels.triton_ops.common import dot_precision, interpreting, next_pow2
from rlsys.kernels.triton_ops.softmax_chunks import chunk_first_step, chunk_of

# step ids counted per vector load when a program looks for its chunk in a CSR list
SCAN = 128


@triton.jit
def chunk_slots(step_ids, first, last, lo_step, hi_step, SCAN: tl.constexpr):
    """[a, b): the slots of an ascending CSR list [first, last) whose steps lie in
    [lo_step, hi_step), by counting (independent vector loads, no dependent search)."""
    below_lo = 0
    below_hi = 0
    for s in range(first, last, SCAN):
        o = s + tl.arange(0, SCAN)
        c = tl.load(step_ids + o, mask=o < last, other=hi_step)
        below_lo += tl.sum((c < lo_step).to(tl.int32), axis=0)
        below_hi += tl.sum((c < hi_step).to(tl.int32), axis=0)
    return first + below_lo, first + below_hi


@triton.jit
def one_row_visibility(
    c, kpos, qpos1, qrow1, hi, present, g, window, sel_bits, sb_stride_n, sb_stride_g,
    SPARSE: tl.constexpr, BLK: tl.constexpr, STEP: tl.constexpr,
):  # fmt: skip
    """`row_visibility` at step c (keys kpos) of a tile whose only query is at qpos1 (query
    row qrow1; none when qpos1 = hi): which keys that query sees, found once per key (one
    bitmap word per step, not one per row) and broadcast over the rows; rows not present
    see nothing. The same mask, so the same bits: the decode walk is bound by instruction
    issue, and most of this mask's integer work was on the tile's empty rows."""
    seen = kpos <= qpos1
    if SPARSE:
        kblk = kpos // BLK
        first_blk = c * STEP // BLK  # the step's first block (steps are STEP-aligned)
        word = tl.load(
            sel_bits + qrow1 * sb_stride_n + g * sb_stride_g + first_blk // 32,
            mask=(qpos1 < hi) & (first_blk * BLK <= qpos1),
            other=0,
        )
        chosen = ((word >> (kblk % 32)) & 1) == 1
        seen = seen & ((kblk == qpos1 // BLK) | chosen)
    else:
        seen = seen & (kpos > qpos1 - window)
    return present[:, None] & seen[None, :]


@triton.jit
def part_step(
    i, q, qk_scale, step_ids, qpos, present, qrow, qpos1, qrow1, hi, g, window, sel_bits,
    sb_stride_n, sb_stride_g, seq, K, V, k_stride_g, block_table, bt_stride, k_stride_r, d,
    D: tl.constexpr, STEP: tl.constexpr, PAGE: tl.constexpr, BLK: tl.constexpr,
    SPARSE: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    ONE_ROW: tl.constexpr, GATHER: tl.constexpr,
):  # fmt: skip
    """`visible_step` of the part walk; with ONE_ROW (every tile of the call holds one
    query: a plain decode step) its mask comes from `one_row_visibility`, and GATHER picks
    `load_keys`' per-key form."""
    if ONE_ROW:
        c, kpos = step_positions(i, step_ids, SPARSE, STEP)
        vis = one_row_visibility(
            c, kpos, qpos1, qrow1, hi, present, g, window, sel_bits, sb_stride_n,
            sb_stride_g, SPARSE, BLK, STEP,
        )  # fmt: skip
        k, v, s = step_scores(
            q, qk_scale, c, kpos < hi, g, seq, K, V, k_stride_g, block_table, bt_stride,
            k_stride_r, d, D, PAGE, STEP, UPCAST, PRECISION, GATHER,
        )  # fmt: skip
    else:
        vis, k, v, s = visible_step(
            i, q, qk_scale, step_ids, qpos, present, qrow, qpos1, hi, g, window, sel_bits,  # qpos1 = lo
            sb_stride_n, sb_stride_g, seq, K, V, k_stride_g, block_table, bt_stride,
            k_stride_r, d, D, STEP, PAGE, BLK, SPARSE, UPCAST, PRECISION,
        )  # fmt: skip
    return vis, k, v, s


@triton.jit
def _attn_fwd_part(
    Q, K, V, PM, PL, PACC,
    q_stride_n, q_stride_h, k_stride_r, k_stride_g, p_stride_n, p_stride_h,
    tile_seq, tile_slot0, tile_lo, tile_hi, tile_row,
    block_table, bt_stride,
    step_off, step_ids,
    sel_bits, sb_stride_n, sb_stride_g,
    qk_scale, window,
    G: tl.constexpr, T: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
    STEP: tl.constexpr, PAGE: tl.constexpr, BLK: tl.constexpr,
    SPARSE: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    LOG_CHUNK: tl.constexpr, LOG_PER_OCTAVE: tl.constexpr, SCAN: tl.constexpr,
    ONE_ROW: tl.constexpr, SUB: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl.wait_prior(PDL)
    pdl.release_next(PDL)
    # SUB > 0 (one query per tile): the SUB slots that hold it (`tile_rows`, one warp)
    GATHER: tl.constexpr = SUB > 0 and not SPARSE  # see `load_keys`
    tile, g, seq, lo, hi, qpos, present, qrow, head, d, first, last = query_tile(
        tile_seq, tile_slot0, tile_lo, tile_hi, tile_row, step_off, window, T, G, DP,
        SPARSE, STEP, SUB,
    )  # fmt: skip
    j = tl.program_id(2)
    if SPARSE:
        # chunks are absolute: program j walks the CSR slots whose steps lie in chunk j
        lo_step = chunk_first_step(j, STEP, LOG_CHUNK, LOG_PER_OCTAVE)
        hi_step = chunk_first_step(j + 1, STEP, LOG_CHUNK, LOG_PER_OCTAVE)
        a, b = chunk_slots(step_ids, first, last, lo_step, hi_step, SCAN)
    else:
        # SWA walks consecutive steps: chunk j is the j-th from the one its first step is in
        jj = chunk_of(first * STEP, LOG_CHUNK, LOG_PER_OCTAVE) + j
        a = tl.maximum(first, chunk_first_step(jj, STEP, LOG_CHUNK, LOG_PER_OCTAVE))
        b = tl.minimum(last, chunk_first_step(jj + 1, STEP, LOG_CHUNK, LOG_PER_OCTAVE))
    q = load_queries(Q, qrow, head, present, d, q_stride_n, q_stride_h, D, UPCAST)
    if SUB:
        m, denom, acc = fresh_state(SUB * G, DP)
    else:
        m, denom, acc = fresh_state(T * G, DP)
    # with ONE_ROW, the tile's one query: its position and row (as `tile_rows` gives them)
    qpos1 = lo
    qrow1 = tl.load(tile_row + tile).to(tl.int64)
    # Two steps' loads are issued before either folds (more bytes in flight per program),
    # folded in order, so the bits are those of one step at a time. On the H200 at `large`'s
    # layer shape the part walk went 176.9 -> 160.2 us at 64 x 4K, 415.5 -> 388.4 us at 64 x
    # 128K, 11.3 -> 10.9 us at 1 x 4K (the pipeline depth, 2-4, within 5%). Query tiles of
    # 8 or 4 slots (32 or 16 MMA rows, not 64) ran slower and changed bits.
    for i in range(a, b - 1, 2):
        vis0, k0, v0, s0 = part_step(
            i, q, qk_scale, step_ids, qpos, present, qrow, qpos1, qrow1, hi, g, window,
            sel_bits, sb_stride_n, sb_stride_g, seq, K, V, k_stride_g, block_table, bt_stride,
            k_stride_r, d, D, STEP, PAGE, BLK, SPARSE, UPCAST, PRECISION, ONE_ROW, GATHER)  # fmt: skip
        vis1, k1, v1, s1 = part_step(
            i + 1, q, qk_scale, step_ids, qpos, present, qrow, qpos1, qrow1, hi, g, window,
            sel_bits, sb_stride_n, sb_stride_g, seq, K, V, k_stride_g, block_table, bt_stride,
            k_stride_r, d, D, STEP, PAGE, BLK, SPARSE, UPCAST, PRECISION, ONE_ROW, GATHER)  # fmt: skip
        m, denom, acc = fold_step(m, denom, acc, vis0, v0, s0, PRECISION, UPCAST)
        m, denom, acc = fold_step(m, denom, acc, vis1, v1, s1, PRECISION, UPCAST)
    for i in range(a + (b - a) // 2 * 2, b):  # the odd step left, if any
        vis, k, v, s = part_step(
            i, q, qk_scale, step_ids, qpos, present, qrow, qpos1, qrow1, hi, g, window,
            sel_bits, sb_stride_n, sb_stride_g, seq, K, V, k_stride_g, block_table, bt_stride,
            k_stride_r, d, D, STEP, PAGE, BLK, SPARSE, UPCAST, PRECISION, ONE_ROW, GATHER)  # fmt: skip
        m, denom, acc = fold_step(m, denom, acc, vis, v, s, PRECISION, UPCAST)
    at = qrow * p_stride_n + head * p_stride_h + j
    tl.store(PM + at, m, mask=present)
    tl.store(PL + at, denom, mask=present)
    # a chunk with no step leaves acc unwritten: every row's denom is 0 there, and the
    # merge reads acc only where some row's denom is not
    if a < b:
        tl.store(PACC + at[:, None] * DP + d[None, :], acc, mask=present[:, None])


@triton.jit
def _attn_merge(
    PM, PL, PACC, Out, LSE, p_stride_n, p_stride_h, o_stride_n, o_stride_h,
    tile_seq, tile_slot0, tile_lo, tile_hi, tile_row, n_chunks,
    GATE, gate_stride_n,
    G: tl.constexpr, T: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
    HAS_GATE: tl.constexpr, SUB: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl.wait_prior(PDL)
    pdl.release_next(PDL)
    tile = tl.program_id(0)
    g = tl.program_id(1)
    # the merge is elementwise per row: any slice of the tile that holds its rows will do
    _, _, _, r, _, present, qrow = tile_rows(
        tile, tile_seq, tile_slot0, tile_lo, tile_hi, tile_row, T, G, SUB
    )
    if SUB:
        m, denom, acc = fresh_state(SUB * G, DP)
    else:
        m, denom, acc = fresh_state(T * G, DP)
    head = g * G + r % G
    d = tl.arange(0, DP)
    # No branch on empty chunks: every chunk's loads are independent of the running state,
    # so they pipeline. A row's empty chunk (-1e30, 0, and an acc read as 0: a chunk with no
    # step never stored it) merges as the identity, bitwise (`merge_state`).
    for j in range(0, n_chunks):
        at = qrow * p_stride_n + head * p_stride_h + j
        lc = tl.load(PL + at, mask=present, other=0.0)
        mc = tl.load(PM + at, mask=present, other=NEG_INIT)
        accc = tl.load(PACC + at[:, None] * DP + d[None, :], mask=present[:, None], other=0.0)
        accc = tl.where((lc > 0)[:, None], accc, 0.0)  # unwritten memory may hold a NaN
        m, denom, acc = merge_state(m, denom, acc, mc, lc, accc)
    finish_rows(
        m, denom, acc, Out, LSE, GATE, gate_stride_n, qrow, head, present, d, o_stride_n,
        o_stride_h, G * tl.num_programs(1), D, HAS_GATE,
    )  # fmt: skip


# What the one-warp part walk's launch sets over the whole tile's (`forward_launch`), e.g. a
# register cap: registers and stages change no bits (the warp count does, and is fixed at
# one). Empty: the whole tile's cap (128 at head dims up to 64). Offline sm_90 compile at
# head dim 64, spilled bytes Sparse GQA / SWA: cap 128 32 / 72, 168 32 / 88, 200 0 / 80,
# none 0 / 0 (218 / 255 registers: 9-8 one-warp programs per SM against 16 at 128). A
# sweep's knob (`bench_attention_walk.py --one-warp-maxnreg`) until the H200 says which
# is faster for this issue-bound walk.
ONE_WARP_LAUNCH: dict[str, int] = {}


def one_warp_launch(head_dim: int) -> dict[str, int]:
    """The launch options of the part walk over one warp's rows (`one_query_slots`)."""
    return {**forward_launch(head_dim), "num_warps": 1, **ONE_WARP_LAUNCH}


def split_attention_forward(
    q: Tensor, k_pool: Tensor, v_pool: Tensor, out: Tensor, lse: Tensor, tiles: QueryTiles,
    kv: PagedKV, *, scale: float, step: int, window: int, sparse: bool,
    csr: tuple[Tensor, Tensor, Tensor], block: int, gate: Tensor | None, chunk: int,
    n_chunks: int,
) -> None:  # fmt: skip
    """`attention_forward` into `out` and `lse`, chunks in parallel (see module doc)."""
    n, h, d = q.shape
    hkv = k_pool.shape[1]
    g, dp = h // hkv, next_pow2(d)
    pm = torch.empty(n, h, n_chunks, dtype=torch.float32, device=q.device)
    pl = torch.empty_like(pm)
    pacc = torch.empty(n, h, n_chunks, dp, dtype=torch.float32, device=q.device)
    step_off, step_ids, bits = csr
    common = {"G": g, "T": tiles.T, "D": d, "DP": dp, **forward_launch(d), **pdl.launch(q.device)}
    grid = (tiles.n_tiles, hkv, n_chunks)
    one_row = max(tiles.host_rows, default=0) == 1  # every tile holds one query
    sub = one_query_slots(tiles, g, common["num_warps"], grid[0] * grid[1] * grid[2])
    part_launch = {**common, **one_warp_launch(d)} if sub else common  # one warp's share
    _attn_fwd_part[grid](
        q, k_pool, v_pool, pm, pl, pacc,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), pm.stride(0), pm.stride(1),
        tiles.seq, tiles.slot0, tiles.lo, tiles.hi, tiles.row,
        kv.block_table, kv.block_table.stride(0),
        step_off, step_ids,
        bits, bits.stride(0), bits.stride(1),
        scale * LOG2E, window,
        STEP=step, PAGE=kv.page_size, BLK=block, SPARSE=sparse, UPCAST=interpreting(),
        PRECISION=dot_precision(q.dtype), SCAN=SCAN, ONE_ROW=one_row, SUB=sub,
        **chunk_constants(chunk), **part_launch,
    )  # fmt: skip
    _attn_merge[(tiles.n_tiles, hkv)](
        pm, pl, pacc, out, lse, pm.stride(0), pm.stride(1), out.stride(0), out.stride(1),
        tiles.seq, tiles.slot0, tiles.lo, tiles.hi, tiles.row, n_chunks,
        gate if gate is not None else q, gate.stride(0) if gate is not None else 0,
        HAS_GATE=gate is not None, SUB=sub, **common,
    )  # fmt: skip
