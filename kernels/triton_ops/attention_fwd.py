"""Forward attention over a paged/packed K/V pool, for gated SWA and Sparse GQA alike.

One program = one query tile (T slots of one sequence) x one KV group: M = T * G rows
ordered (slot, head), so the G heads that share a KV group share every K/V load and the
MMA has M rows even in decode (one present slot). Keys are visited in *steps* of STEP
consecutive absolute positions aligned to STEP:
- SWA: every step from the first one a present row's window reaches to the last present
  position (a contiguous range);
- Sparse GQA: the union, over the tile's present rows, of the steps holding a selected
  block or the row's own (current) block, ascending (a CSR list built by the indexer).

Batch invariance (docs/ARCHITECTURE.md, "Numerics"), why it holds:
- a row's scores are `dot(q_row, k)`: row-independent MMA, one fixed K-loop over D;
- the online softmax visits, for every row, the same aligned steps in ascending order;
  a step in which a row sees nothing (a union step it did not select, a window step out of
  its reach) leaves its (m, l, acc) bitwise unchanged: its reference m does not move,
  exp2(0) = 1, p = exp2(-inf) = 0 and acc * 1 + dot(0, v) = acc;
- a row's reference m moves only on its own keys (its maximum; from head dim 128,
  `fold_step`'s slack rule), and a program skips the rescale only where no row with keys
  folded moves (alpha = 1 for every other row: it multiplies by exactly 1);
- a step loads every key before the tile's end (all written; `step_keys` says why not
  only the visible ones); a key no row sees scores -inf, so p = 0 and p * v is a zero.
So a token's output is the same in a decode step of any batch, in a chunked prefill and in
the trainer's packed forward. m starts at -1e30 (finite), so the first visible step
moves it and rescales the empty state by exp2(-1e30 - m) = 0 without producing a NaN.

Softmax chunks: the online softmax restarts at fixed key positions, the chunk boundaries,
and merges the chunk's state into the row's running state (`merge_state`, chunks
ascending). Chunks are `chunk` (`SOFTMAX_CHUNK`) positions wide up to 2 * P * chunk (P =
`CHUNKS_PER_OCTAVE`), then P to an octave: [2^o, 2^(o+1)) splits into P chunks of 2^o / P
(`softmax_chunks`). Every width is a power of two of at least one step, so no step straddles a
boundary; a row at position L crosses O(log L) boundaries past the first 2P, so a long
context's scattered Sparse GQA selection does not pay a merge at nearly every step. A chunk
a row sees nothing of merges as the identity, bitwise, so the split walk
(`attention_split`: one program per chunk, then a merge in chunk order) gives the same
bits as this single walk; a decode call, whose tiles hold one row each, walks its chunks
in parallel that way.
Outputs: O (N, H, D) in q's dtype, LSE (N, H) fp32 in base 2 (for the backward).

Why one file over 600 lines: the step's pieces here (visibility, loads, scores, the fold
and the merge) are what every other walk is built from (`attention_split`, the backward,
the block mass), and they must stay one definition for the walks to agree bitwise; the
chunk rule lives in `softmax_chunks`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from rlsys.kernels.attention_plan import PagedKV, QueryTiles
from rlsys.kernels.triton_ops import pdl
from rlsys.kernels.triton_ops.common import (
    check_device,
    dot_precision,
    interpreting,
    mma,
    next_pow2,
)
from rlsys.kernels.triton_ops.softmax_chunks import (
    chunk_first_step,
    chunk_index,
    chunk_of,
    log2_exact,
    softmax_chunk,
)

LOG2E = 1.4426950408889634
NEG_INIT = tl.constexpr(-1.0e30)
# How far (log2 units) a step's maximum may pass a row's softmax reference before the row
# rescales (`fold_step`, head dims from LAZY_RESCALE_MIN_DIM): p stays <= 2^8, far from
# fp32's or bf16's range, and after a row's first visible step of a chunk most steps
# rescale no row. Part of the numerics (engine and trainer fold alike), so a constant.
RESCALE_SLACK = tl.constexpr(8.0)
# Head dims (padded) from which `fold_step` keeps a slack reference, so that most steps
# move no row's reference (part of the numerics: a function of the model's head dim, like
# the launch options). At 64 the slack test cost as much as the rescales it spared
# (offline sm_90 SASS; BENCHMARKS, kernel instructions).
LAZY_RESCALE_MIN_DIM = tl.constexpr(128)
# With the slack reference: a program rescales acc only when some row needs it (True: a
# branch on a reduction over the whole tile, which crosses warps: shared memory and a
# barrier every step), or every step (False: the rows that do not move multiply by exactly
# 1). The same bits either way (tests/kernels/test_attention_split.py). Every step: 32K
# Sparse GQA prefill at the deep-92 layer shape 14.25 -> 12.88 ms, 128K 77.6 -> 69.0 on
# the H100 (one call; the skipped multiplies had looked like 11% of a step in offline
# SASS). A compile-time global, so a benchmark sets it before the first launch.
RESCALE_ON_DEMAND = tl.constexpr(False)

# Launch options of the forward. Engine and trainer launch it alike (a program's reductions
# follow its layout, which the warp count sets), so they depend on the head dim only.
FORWARD_LAUNCH: dict[str, int] = {"num_warps": 4, "num_stages": 3}
# Registers per thread at head dims up to 64: uncapped, the walk (with the chunk state, a
# second accumulator) took 180-222 registers, two programs per SM. With its loads keyed on
# the tile's end it fits 128 without spilling: four programs per SM, 32K Sparse GQA prefill
# 9.68 -> 8.63 ms against a cap of 168 on the H200 (SWA -9%; the single-walk decode at 64 x
# 128K +5%, which the split walk serves up to 512 programs). At head dim 128 the walk needs
# ~230-255 either way (a cap of 168 spilled, 9-44% slower).
NARROW_HEAD_MAX_REGISTERS = 128
# The single walk folds its steps one loop trip each (False) or two per trip, both steps'
# loads and scores issued before either folds (True; the split walk's part loop does so).
# The bits are the same either way (each step folds after its own chunk turn, in order), so
# engine and trainer may differ in it; read at call time, so a benchmark can sweep it. Two
# per trip: 32K Sparse GQA prefill 14.25 -> 13.28 ms, 128K 77.6 -> 70.0 on the H100; with
# the rescale every step, 12.24 / 65.0 (one call, `bench_attention.py`). The same pairing
# in the dq and dK/dV walks lost (dq 10.2 -> 11.8 ms, dK/dV 22.5 -> 26.0 at head dim 128,
# even at 64), so they take one step or tile per trip.
FORWARD_PAIRED_STEPS = True
# Where a call's K/V rows are consecutive per sequence (`PagedKV.contiguous`: the trainer's
# packed K/V), the walks address a key as its sequence's first row plus its position,
# loaded once per program, instead of a page-table entry per step (Nsight Compute on the
# H100: that entry and its trip through shared memory were ~18% of the forward walk's
# stall samples at 32K). The same values either way (tested on the H100 too); read at call
# time. 32K Sparse GQA forward 12.39 / 12.28 -> 11.72 / 11.70 ms on the H100 (two pairs,
# one call); the backward unchanged. The engine's paged K/V walks the table as before.
CONTIGUOUS_ROWS = True


def set_rescale_on_demand(on: bool) -> None:
    """Set `RESCALE_ON_DEMAND` (a compile-time global: before the first launch compiles the
    walks; a benchmark's switch, the bits are the same either way)."""
    global RESCALE_ON_DEMAND
    RESCALE_ON_DEMAND = tl.constexpr(on)


def contiguous_rows(kv: PagedKV) -> bool:
    """Whether the walks address `kv`'s keys from each sequence's first row
    (`CONTIGUOUS_ROWS`, read now, and a table whose pages are consecutive rows)."""
    return kv.contiguous and CONTIGUOUS_ROWS


def forward_launch(head_dim: int) -> dict[str, int]:
    """The forward kernels' launch options for a head dim (the same in engine and trainer)."""
    if next_pow2(head_dim) <= 64:  # a cap set in FORWARD_LAUNCH (a benchmark's sweep) wins
        return {"maxnreg": NARROW_HEAD_MAX_REGISTERS, **FORWARD_LAUNCH}
    return dict(FORWARD_LAUNCH)


# The softmax chunk boundaries (see module doc). Part of the numerics (engine and trainer
# must merge at the same positions), so constants. 256-position chunks give a decode step at
# 4K context 16 parallel chunks per KV group; past 4K (2 * 8 * 256) eight chunks per octave
# keep a 128K row at 56 chunks (512 at a flat 256) and the split walk's chunk states as few.
SOFTMAX_CHUNK = 256
CHUNKS_PER_OCTAVE = 8


@triton.jit
def row_visibility(
    qpos, present, qrow, k0, lo, hi, g, window, sel_bits, sb_stride_n, sb_stride_g,
    SPARSE: tl.constexpr, BLK: tl.constexpr, STEP: tl.constexpr,
):  # fmt: skip
    """(M, STEP) bool: row (a query at qpos, present in this call) sees key kpos of the
    step's keys kpos = k0 + [0, STEP); the tile's present positions are [lo, hi).

    Sparse GQA: most steps of a prefill walk lie wholly before the tile's first query's
    block: there every present row's causal test passes and no key is in a row's own
    block, so the mask is the selection bits alone; a branch on scalars, the per-key tests
    run only near the diagonal. SWA: the causal and window tests are one unsigned compare
    per key (a branch like Sparse GQA's cost the forward walk more than it saved). The
    same masks, fewer instructions per step."""
    kpos = k0 + tl.arange(0, STEP)
    if SPARSE:
        # A step (STEP aligned positions, STEP <= 32 * BLK, powers of two) lies in one 32-bit
        # word of each row's bitmap: one load per row, not one per (row, key).
        tl.static_assert(STEP <= 32 * BLK)
        first_blk = k0 // BLK
        word = tl.load(
            sel_bits + qrow * sb_stride_n + g * sb_stride_g + first_blk // 32,
            mask=present & (first_blk * BLK <= qpos),
            other=0,
        )
        shift = first_blk % 32 + tl.arange(0, STEP) // BLK
        chosen = ((word[:, None] >> shift[None, :]) & 1) == 1
        if k0 + STEP <= lo // BLK * BLK:  # before every present row's own block
            vis = chosen
        else:
            causal = (kpos[None, :] <= qpos[:, None]) & present[:, None]
            own = (kpos // BLK)[None, :] == (qpos // BLK)[:, None]
            vis = causal & (own | chosen)
    else:
        # causal and inside the window: 0 <= qpos - kpos < window, one unsigned compare
        ahead = (qpos[:, None] - kpos[None, :]).to(tl.uint32, bitcast=True)
        # (a window of 1 reaches a kernel as the constant 1: Triton specialises it)
        reach = (tl.full([], 0, tl.int32) + window).to(tl.uint32, bitcast=True)
        vis = present[:, None] & (ahead < reach)
    return vis


@triton.jit
def tile_rows(
    tile, tile_seq, tile_slot0, tile_lo, tile_hi, tile_row, T: tl.constexpr, G: tl.constexpr,
    SUB: tl.constexpr = 0, HEAD_MAJOR: tl.constexpr = False,
):  # fmt: skip
    """Per tile row (slot, head): query position, presence and query row; plus the tile's
    seq. SUB > 0: only the SUB slots [base, base + SUB) that hold the tile's first query,
    base = the tile's first slot plus that query's offset rounded down to SUB, so each row
    keeps its offset within its SUB-slot group (a one-query tile's slice: with SUB * G =
    16, the rows one warp owns of the whole tile's MMA; `attention_split`). HEAD_MAJOR:
    row r is head r // T of slot r % T (the block mass's layout), not slot r // G."""
    seq = tl.load(tile_seq + tile)
    slot0 = tl.load(tile_slot0 + tile)
    lo = tl.load(tile_lo + tile)
    hi = tl.load(tile_hi + tile)
    row0 = tl.load(tile_row + tile)
    if SUB:
        r = tl.arange(0, SUB * G)
        qpos = slot0 + (lo - slot0) // SUB * SUB + r // G
    elif HEAD_MAJOR:
        r = tl.arange(0, T * G)
        qpos = slot0 + r % T
    else:
        r = tl.arange(0, T * G)
        qpos = slot0 + r // G
    present = (qpos >= lo) & (qpos < hi)
    qrow = tl.where(present, row0 + qpos - lo, 0).to(tl.int64)
    return seq, lo, hi, r, qpos, present, qrow


@triton.jit
def step_bounds(tile, g, lo, hi, step_off, window, SPARSE: tl.constexpr, STEP: tl.constexpr):
    """[first, last) of the step loop: CSR slots (sparse) or aligned step indices (SWA)."""
    if SPARSE:
        first = tl.load(step_off + tile * tl.num_programs(1) + g)
        last = tl.load(step_off + tile * tl.num_programs(1) + g + 1)
    else:
        first = tl.maximum(lo - window + 1, 0) // STEP
        last = (hi - 1) // STEP + 1
    return first, last


@triton.jit
def key_rows(block_table, bt_stride, seq, kpos, mask, PAGE: tl.constexpr):
    """Pool rows (int64) of sequence `seq`'s keys at positions `kpos`, one page-table
    entry per key (0 where not `mask`)."""
    page_row = tl.load(block_table + seq * bt_stride + kpos // PAGE, mask=mask, other=0)
    return (page_row + kpos % PAGE).to(tl.int64)


@triton.jit
def load_keys(
    base, block_table, bt_stride, seq, c, kneed, stride_r, d, D: tl.constexpr,
    PAGE: tl.constexpr, STEP: tl.constexpr, GATHER: tl.constexpr = False,
    CONTIG: tl.constexpr = False, seq_row0=0,
):  # fmt: skip
    """(STEP, DP) rows of a pool at aligned step c, positions c * STEP + [0, STEP) (zeros
    where not `kneed`). A step lies in one page (PAGE % STEP == 0, asserted at launch), so
    it takes one page-table entry, a scalar load (every walked step starts before its
    sequence's end: the entry exists), and its keys are consecutive pool rows: an address
    is the step's first row plus a loop-invariant offset, not a gathered page row and a
    64-bit multiply per key (the decode walk is bound by instruction issue). GATHER: the
    per-key form, where the offsets cost more than they save in offline sm_90 SASS (the
    SWA part walk on one warp spilled more, the SWA dq walk spilled predicates). CONTIG: the
    sequence's rows are consecutive from `seq_row0` (`PagedKV.contiguous`, the caller
    loaded it once), so a key's row is that plus its position, with no page-table load in
    the step's chain. The same values in every form."""
    first = c * STEP
    if CONTIG:
        row0 = (seq_row0 + first).to(tl.int64)
        ptrs = base + row0 * stride_r + (tl.arange(0, STEP)[:, None] * stride_r + d[None, :])
    elif GATHER:
        krow = key_rows(block_table, bt_stride, seq, first + tl.arange(0, STEP), kneed, PAGE)
        ptrs = base + krow[:, None] * stride_r + d[None, :]
    else:
        page_row = tl.load(block_table + seq * bt_stride + first // PAGE)
        row0 = (page_row + first % PAGE).to(tl.int64)  # pools pass 2^31 elements at long context
        ptrs = base + row0 * stride_r + (tl.arange(0, STEP)[:, None] * stride_r + d[None, :])
    return tl.load(ptrs, mask=kneed[:, None] & (d < D)[None, :], other=0.0)


@triton.jit
def query_tile(
    tile_seq, tile_slot0, tile_lo, tile_hi, tile_row, step_off, window,
    T: tl.constexpr, G: tl.constexpr, DP: tl.constexpr, SPARSE: tl.constexpr,
    STEP: tl.constexpr, SUB: tl.constexpr = 0,
):  # fmt: skip
    """What a (query tile, KV group) program walks: its tile and group (program ids 0 and
    1), the tile's rows (`tile_rows`, SUB: a slice of them), each row's head, the feature
    offsets d (DP,), and the bounds [first, last) of its step walk (`step_bounds`)."""
    tile = tl.program_id(0)
    g = tl.program_id(1)
    seq, lo, hi, r, qpos, present, qrow = tile_rows(
        tile, tile_seq, tile_slot0, tile_lo, tile_hi, tile_row, T, G, SUB
    )
    head = g * G + r % G
    d = tl.arange(0, DP)
    first, last = step_bounds(tile, g, lo, hi, step_off, window, SPARSE, STEP)
    return tile, g, seq, lo, hi, qpos, present, qrow, head, d, first, last


@triton.jit
def step_positions(i, step_ids, SPARSE: tl.constexpr, STEP: tl.constexpr):
    """Step `i` of a walk (a CSR slot, sparse; an aligned step index, SWA): the step c and
    its STEP key positions."""
    if SPARSE:
        c = tl.load(step_ids + i)
    else:
        c = i
    return c, c * STEP + tl.arange(0, STEP)


@triton.jit
def step_keys(
    i, step_ids, qpos, present, qrow, lo, hi, g, window, sel_bits, sb_stride_n, sb_stride_g,
    SPARSE: tl.constexpr, STEP: tl.constexpr, BLK: tl.constexpr,
):  # fmt: skip
    """Step `i` of a query tile's walk (a CSR slot, sparse; an aligned step index, SWA):
    the step c, its STEP key positions, which row sees which key (M, STEP), and which keys
    are loaded (STEP,): those before `hi`, the tile's end, all of them written.

    Why not only the keys some row sees: that mask needs the selection bitmap's word, so
    the K/V loads would wait on a load that waits on the step id, three dependent loads per
    step that the software pipeline cannot overlap (Triton left the page-row and K/V loads
    synchronous). Keyed on `hi`, the loads depend on the step id alone. A loaded key no row
    sees changes no value: its score is masked to -inf, p = 0, and p * v is a zero."""
    c, kpos = step_positions(i, step_ids, SPARSE, STEP)
    vis = row_visibility(
        qpos, present, qrow, c * STEP, lo, hi, g, window, sel_bits, sb_stride_n, sb_stride_g,
        SPARSE, BLK, STEP,
    )  # fmt: skip
    kneed = kpos < hi
    return c, kpos, vis, kneed


@triton.jit
def visible_step(
    i, q, qk_scale, step_ids, qpos, present, qrow, lo, hi, g, window, sel_bits, sb_stride_n,
    sb_stride_g, seq, K, V, k_stride_g, block_table, bt_stride, k_stride_r, d,
    D: tl.constexpr, STEP: tl.constexpr, PAGE: tl.constexpr, BLK: tl.constexpr,
    SPARSE: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    GATHER: tl.constexpr = False, CONTIG: tl.constexpr = False, seq_row0=0,
):  # fmt: skip
    """Step `i` of the walk, loaded, as the forward and the dq backward both take it:
    (vis, k, v, s), s = q k^T * qk_scale for every row and key (keys a row does not see are
    the caller's to mask with `vis`; keys at or past the tile's end are zeros, never read;
    GATHER, CONTIG: `load_keys`' other forms)."""
    c, _, vis, kneed = step_keys(
        i, step_ids, qpos, present, qrow, lo, hi, g, window, sel_bits, sb_stride_n,
        sb_stride_g, SPARSE, STEP, BLK,
    )  # fmt: skip
    k, v, s = step_scores(
        q, qk_scale, c, kneed, g, seq, K, V, k_stride_g, block_table, bt_stride,
        k_stride_r, d, D, PAGE, STEP, UPCAST, PRECISION, GATHER, CONTIG, seq_row0,
    )  # fmt: skip
    return vis, k, v, s


@triton.jit
def step_scores(
    q, qk_scale, c, kneed, g, seq, K, V, k_stride_g, block_table, bt_stride, k_stride_r, d,
    D: tl.constexpr, PAGE: tl.constexpr, STEP: tl.constexpr, UPCAST: tl.constexpr,
    PRECISION: tl.constexpr, GATHER: tl.constexpr = False, CONTIG: tl.constexpr = False,
    seq_row0=0,
):  # fmt: skip
    """Step c's keys and values (zeros where not `kneed`; GATHER, CONTIG: `load_keys`'
    other forms), and the scores s = q k^T * qk_scale of every row and key."""
    k_base, v_base = K + g * k_stride_g, V + g * k_stride_g
    k = load_keys(
        k_base, block_table, bt_stride, seq, c, kneed, k_stride_r, d, D, PAGE, STEP, GATHER,
        CONTIG, seq_row0,
    )  # fmt: skip
    v = load_keys(
        v_base, block_table, bt_stride, seq, c, kneed, k_stride_r, d, D, PAGE, STEP, GATHER,
        CONTIG, seq_row0,
    )  # fmt: skip
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = mma(q, tl.trans(k), PRECISION, UPCAST) * qk_scale
    return k, v, s


@triton.jit
def fresh_state(M: tl.constexpr, DP: tl.constexpr):
    """(m, denom, acc) of a row that has seen nothing."""
    return (
        tl.full([M], NEG_INIT, tl.float32),
        tl.zeros([M], tl.float32),
        tl.zeros([M, DP], tl.float32),
    )


@triton.jit
def fold_step(m, denom, acc, vis, v, s, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """One step of the online softmax: scores s (M, STEP), visible where `vis`.

    Below LAZY_RESCALE_MIN_DIM (padded head dim, fixed by the model, so engine and trainer
    fold alike) m is the row's running maximum and every step rescales. From it on, m is
    a row's reference: it moves to the step's maximum only when that passes it by more
    than RESCALE_SLACK (and on the row's first visible step, from NEG_INIT), so
    p = exp2(s - m) <= 2^RESCALE_SLACK, and the M x D rescale of acc runs only where some
    row moves with keys already folded (denom > 0). A row that does not move has alpha =
    exp2(0) = 1 exactly, and acc * 1 = acc, fma(denom, 1, x) = denom + x; a row that moves
    from the empty state holds zeros, and 0 * alpha = 0. So a row's bits do not depend on
    whether its program took the branch, only on its own visible keys (batch invariance
    holds as before), and a chunk's first step does not rescale. Either way the state
    (m, denom, acc) means sum_k exp2(s_k - m) (1, v_k), all that `merge_state` and
    `finish_rows` read. `RESCALE_ON_DEMAND` off (the default) rescales every step with
    the slack reference: the rows that do not move multiply by exactly 1, so the bits are
    those of the branch."""
    s = tl.where(vis, s, float("-inf"))
    top = tl.max(s, axis=1)
    if acc.shape[1] >= LAZY_RESCALE_MIN_DIM:
        moves = top > m + RESCALE_SLACK
        m_new = tl.where(moves, top, m)
        p = tl.exp2(s - m_new[:, None])
        psum = tl.sum(p, axis=1)
        if not RESCALE_ON_DEMAND:
            denom, acc = _rescaled(m, m_new, denom, psum, acc)
        elif tl.max((moves & (denom > 0)).to(tl.int32), axis=0) > 0:
            denom, acc = _rescaled(m, m_new, denom, psum, acc)
        else:
            denom = denom + psum
        acc = acc + mma(p.to(v.dtype), v, PRECISION, UPCAST)
    else:
        m_new = tl.maximum(m, top)
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, PRECISION, UPCAST)
    return m_new, denom, acc


@triton.jit
def _rescaled(m, m_new, denom, psum, acc):
    """(denom, acc) moved from reference m to m_new, the step's row sums added: an explicit
    FMA, so every walk rounds it alike."""
    alpha = tl.exp2(m - m_new)
    return tl.fma(denom, alpha, psum), acc * alpha[:, None]


@triton.jit
def merge_state(m, denom, acc, mc, lc, accc):
    """A chunk's state merged into the running one. Explicit FMAs, so the fused walk and
    the split merge (registers here, memory there) round alike; an empty chunk (-1e30, 0,
    0) leaves the running state bitwise unchanged, as does merging into an empty one."""
    m_new = tl.maximum(m, mc)
    a = tl.exp2(m - m_new)
    b = tl.exp2(mc - m_new)
    denom = tl.fma(denom, a, lc * b)
    acc = tl.fma(acc, a[:, None], accc * b[:, None])
    return m_new, denom, acc


@triton.jit
def finish_rows(
    m, denom, acc, Out, LSE, GATE, gate_stride_n, qrow, head, present, d, o_stride_n,
    o_stride_h, n_heads, D: tl.constexpr, HAS_GATE: tl.constexpr,
):  # fmt: skip
    """Normalise, gate and store the rows' outputs and their LSE (base 2)."""
    seen = denom > 0
    out = (acc / tl.where(seen, denom, 1.0)[:, None]).to(Out.dtype.element_ty)
    if HAS_GATE:
        # the output gate, as `out * gate` after the store would compute it: the rounded
        # output times the rounded gate, in fp32, rounded again
        gate = tl.load(GATE + qrow * gate_stride_n + head, mask=present, other=0.0)
        out = (out.to(tl.float32) * gate.to(tl.float32)[:, None]).to(Out.dtype.element_ty)
    tl.store(
        Out + qrow[:, None] * o_stride_n + head[:, None] * o_stride_h + d[None, :],
        out,
        mask=present[:, None] & (d < D)[None, :],
    )
    lse = tl.where(seen, m + tl.log2(tl.where(seen, denom, 1.0)), float("-inf"))
    tl.store(LSE + qrow * n_heads + head, lse, mask=present)


@triton.jit
def load_queries(Q, qrow, head, present, d, q_stride_n, q_stride_h, D: tl.constexpr,
                 UPCAST: tl.constexpr):  # fmt: skip
    q = tl.load(
        Q + qrow[:, None] * q_stride_n + head[:, None] * q_stride_h + d[None, :],
        mask=present[:, None] & (d < D)[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    return q


@triton.jit
def sequence_row0(block_table, bt_stride, seq, CONTIG: tl.constexpr):
    """The pool row of sequence `seq`'s first key where its rows are consecutive (CONTIG:
    `PagedKV.contiguous`), loaded once per program; 0 (unused) otherwise."""
    if CONTIG:
        row0 = tl.load(block_table + seq * bt_stride)
    else:
        row0 = 0
    return row0


@triton.jit
def chunk_turn(
    c, bound, m, denom, acc, mc, lc, accc, STEP: tl.constexpr, LOG_CHUNK: tl.constexpr,
    LOG_PER_OCTAVE: tl.constexpr,
):  # fmt: skip
    """Before step c folds: if it reaches `bound` (the first step of the chunk after the
    current one), the current chunk's state merges into the row's and restarts, and the
    bound moves past c's chunk. Returns (bound, m, denom, acc, mc, lc, accc)."""
    if c >= bound:
        m, denom, acc = merge_state(m, denom, acc, mc, lc, accc)
        mc, lc, accc = fresh_state(acc.shape[0], acc.shape[1])
        c_chunk = chunk_of(c * STEP, LOG_CHUNK, LOG_PER_OCTAVE)
        bound = chunk_first_step(c_chunk + 1, STEP, LOG_CHUNK, LOG_PER_OCTAVE)
    return bound, m, denom, acc, mc, lc, accc


@triton.jit
def _attn_fwd(
    Q, K, V, Out, LSE,
    q_stride_n, q_stride_h, k_stride_r, k_stride_g, o_stride_n, o_stride_h,
    tile_seq, tile_slot0, tile_lo, tile_hi, tile_row,
    block_table, bt_stride,
    step_off, step_ids,
    sel_bits, sb_stride_n, sb_stride_g,
    qk_scale, window,
    GATE, gate_stride_n,
    G: tl.constexpr, T: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
    STEP: tl.constexpr, PAGE: tl.constexpr, BLK: tl.constexpr,
    SPARSE: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    HAS_GATE: tl.constexpr, LOG_CHUNK: tl.constexpr, LOG_PER_OCTAVE: tl.constexpr,
    PAIRED: tl.constexpr = False, CONTIG: tl.constexpr = False, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl.wait_prior(PDL)
    pdl.release_next(PDL)
    tile, g, seq, lo, hi, qpos, present, qrow, head, d, first, last = query_tile(
        tile_seq, tile_slot0, tile_lo, tile_hi, tile_row, step_off, window, T, G, DP, SPARSE, STEP
    )
    seq_row0 = sequence_row0(block_table, bt_stride, seq, CONTIG)
    q = load_queries(Q, qrow, head, present, d, q_stride_n, q_stride_h, D, UPCAST)
    m, denom, acc = fresh_state(T * G, DP)
    mc, lc, accc = fresh_state(T * G, DP)
    # The first step of the chunk after the one whose state mc, lc, accc hold (-1: none
    # yet). Steps ascend, so a step starts a new chunk exactly when it reaches this bound:
    # the chunk rule runs once per chunk, not once per step.
    bound = first * 0 - 1
    if PAIRED:
        # two steps' loads and scores issued before either folds; folded in order, each
        # after its own chunk turn, so the bits are those of one step at a time
        for i in range(first, last - 1, 2):
            vis0, k0, v0, s0 = visible_step(
                i, q, qk_scale, step_ids, qpos, present, qrow, lo, hi, g, window, sel_bits,
                sb_stride_n, sb_stride_g, seq, K, V, k_stride_g, block_table, bt_stride,
                k_stride_r, d, D, STEP, PAGE, BLK, SPARSE, UPCAST, PRECISION, False, CONTIG,
                seq_row0)  # fmt: skip
            vis1, k1, v1, s1 = visible_step(
                i + 1, q, qk_scale, step_ids, qpos, present, qrow, lo, hi, g, window,
                sel_bits, sb_stride_n, sb_stride_g, seq, K, V, k_stride_g, block_table,
                bt_stride, k_stride_r, d, D, STEP, PAGE, BLK, SPARSE, UPCAST, PRECISION, False,
                CONTIG, seq_row0)  # fmt: skip
            c0, _ = step_positions(i, step_ids, SPARSE, STEP)
            bound, m, denom, acc, mc, lc, accc = chunk_turn(
                c0, bound, m, denom, acc, mc, lc, accc, STEP, LOG_CHUNK, LOG_PER_OCTAVE
            )
            mc, lc, accc = fold_step(mc, lc, accc, vis0, v0, s0, PRECISION, UPCAST)
            c1, _ = step_positions(i + 1, step_ids, SPARSE, STEP)
            bound, m, denom, acc, mc, lc, accc = chunk_turn(
                c1, bound, m, denom, acc, mc, lc, accc, STEP, LOG_CHUNK, LOG_PER_OCTAVE
            )
            mc, lc, accc = fold_step(mc, lc, accc, vis1, v1, s1, PRECISION, UPCAST)
        rest = first + (last - first) // 2 * 2  # the odd step left, if any
    else:
        rest = first
    for i in range(rest, last):
        c, _ = step_positions(i, step_ids, SPARSE, STEP)
        bound, m, denom, acc, mc, lc, accc = chunk_turn(
            c, bound, m, denom, acc, mc, lc, accc, STEP, LOG_CHUNK, LOG_PER_OCTAVE
        )
        vis, k, v, s = visible_step(
            i, q, qk_scale, step_ids, qpos, present, qrow, lo, hi, g, window, sel_bits, sb_stride_n,
            sb_stride_g, seq, K, V, k_stride_g, block_table, bt_stride, k_stride_r, d,
            D, STEP, PAGE, BLK, SPARSE, UPCAST, PRECISION, False, CONTIG, seq_row0)  # fmt: skip
        mc, lc, accc = fold_step(mc, lc, accc, vis, v, s, PRECISION, UPCAST)
    m, denom, acc = merge_state(m, denom, acc, mc, lc, accc)
    finish_rows(
        m, denom, acc, Out, LSE, GATE, gate_stride_n, qrow, head, present, d, o_stride_n,
        o_stride_h, G * tl.num_programs(1), D, HAS_GATE,
    )  # fmt: skip


_NO_SELECTION: dict[torch.device, tuple[Tensor, Tensor, Tensor]] = {}


def no_selection(device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """Placeholder CSR/bitmap arguments for SWA launches (never read): allocated once per
    device (two fill launches per SWA layer otherwise; never inside a graph capture, which
    the engine's eager warm-up precedes)."""
    if device not in _NO_SELECTION:
        with torch.inference_mode(False):
            z = torch.zeros(1, dtype=torch.int32, device=device)
            _NO_SELECTION[device] = (z, z, torch.zeros(1, 1, 1, dtype=torch.int32, device=device))
    return _NO_SELECTION[device]


def attention_forward(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    tiles: QueryTiles,
    kv: PagedKV,
    *,
    scale: float,
    step: int,
    window: int = 0,
    sparse: tuple[Tensor, Tensor, Tensor] | None = None,
    block: int = 1,
    gate: Tensor | None = None,
    chunk: int | None = None,
    split: bool | None = None,
) -> tuple[Tensor, Tensor]:
    """q (N, H, D), pools (R, Hkv, D) -> out (N, H, D) in q's dtype, lse (N, H) fp32 base 2.

    `sparse` = (step_off (n_tiles * Hkv + 1,), step_ids, sel_bits (N, Hkv, NW)) selects
    Sparse GQA; otherwise SWA with `window`. `gate` (N, H) in q's dtype: the output is
    `out * gate[..., None]` (the attention output gate, fused; inference only: the
    backward reads the ungated output). `chunk`: key positions per softmax chunk (module
    doc; None: `SOFTMAX_CHUNK`, read at call time, so a benchmark can sweep it). `split`:
    walk the chunks in parallel and merge them after (bitwise the same); None decides by
    the call's shape (`splits_chunks`).
    """
    check_device(q, k_pool, v_pool)
    n, h, d = q.shape
    hkv = k_pool.shape[1]
    g = h // hkv
    assert tiles.T * g >= 16 and step >= 16 and kv.page_size % step == 0
    chunk = softmax_chunk(step, SOFTMAX_CHUNK if chunk is None else chunk)
    out = torch.empty_like(q)
    lse = torch.empty(n, h, dtype=torch.float32, device=q.device)
    if n == 0:
        return out, lse
    step_off, step_ids, bits = sparse if sparse is not None else no_selection(q.device)
    n_chunks = walk_chunks(tiles, step, window, sparse is not None, chunk)
    if split if split is not None else splits_chunks(tiles, hkv, chunk, n_chunks, g):
        # imported here: attention_split builds its kernels from this module's helpers
        from rlsys.kernels.triton_ops.attention_split import split_attention_forward

        split_attention_forward(
            q, k_pool, v_pool, out, lse, tiles, kv, scale=scale, step=step, window=window,
            sparse=sparse is not None, csr=(step_off, step_ids, bits), block=block, gate=gate,
            chunk=chunk, n_chunks=n_chunks,
        )  # fmt: skip
        return out, lse
    _attn_fwd[(tiles.n_tiles, hkv)](
        q, k_pool, v_pool, out, lse,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), out.stride(0), out.stride(1),
        tiles.seq, tiles.slot0, tiles.lo, tiles.hi, tiles.row,
        kv.block_table, kv.block_table.stride(0),
        step_off, step_ids,
        bits, bits.stride(0), bits.stride(1),
        scale * LOG2E, window,
        gate if gate is not None else q, gate.stride(0) if gate is not None else 0,
        G=g, T=tiles.T, D=d, DP=next_pow2(d), STEP=step, PAGE=kv.page_size, BLK=block,
        SPARSE=sparse is not None, UPCAST=interpreting(), PRECISION=dot_precision(q.dtype),
        HAS_GATE=gate is not None, PAIRED=FORWARD_PAIRED_STEPS,
        CONTIG=contiguous_rows(kv), **chunk_constants(chunk), **forward_launch(d),
        **pdl.launch(q.device),
    )  # fmt: skip
    return out, lse


# The split walk's bounds. Fewer (tile, group) programs than SPLIT_BELOW_PROGRAMS leave the
# GPU's memory system idle: `large` at 4K context, batch 1, 3.9 -> 0.85 ms of attention per
# decode step on the H200; batch 64 (256 programs) was even (4.6 -> 4.5 ms). Past
# SPLIT_MAX_CHUNK_PROGRAMS, empty chunks and the merge's serial loop cost more than the
# parallel walk wins: batch 64 at 128K (512 chunks, all split) went 1.0 -> 4.1 ms.
SPLIT_BELOW_PROGRAMS = 512
SPLIT_MAX_CHUNK_PROGRAMS = 16384
# One-query tiles whose part walk runs on one warp's rows split past both bounds: at
# `large`'s layer shape on the H200 the split walk took 0.161 / 0.312 ms at 128 / 256 x 4K
# against the single walk's 0.344 / 0.678 (Sparse GQA), and 0.70 against 1.34 ms at
# 256 x 128K (57,344 chunk programs). A benchmark may turn it off.
SPLIT_ONE_WARP = True


def chunk_constants(chunk: int) -> dict[str, int]:
    """The kernels' constexprs for the chunk rule: log2 of the base width and of P."""
    return {
        "LOG_CHUNK": log2_exact(chunk, "softmax chunk"),
        "LOG_PER_OCTAVE": log2_exact(CHUNKS_PER_OCTAVE, "chunks per octave"),
    }


def walk_chunks(tiles: QueryTiles, step: int, window: int, sparse: bool, chunk: int) -> int:
    """Chunks a split call walks per (tile, group): every chunk up to the largest query
    position (Sparse GQA), or as many as one tile's window walk can straddle (SWA; no
    chunk is narrower than `chunk`, so the flat count bounds it)."""
    if sparse:
        return chunk_index(tiles.max_pos, chunk, CHUNKS_PER_OCTAVE) + 1
    # the walk spans window + T - 1 positions, widened to whole steps at its first end
    return (window + tiles.T - 1 + step) // chunk + 2


# Rows of a query tile's MMA that one warp owns (the forward's 4 warps split a tile of 64 or
# more rows along M: 16 each, in order, with wgmma as with mma.sync).
MMA_WARP_ROWS = 16
# One-warp part programs below this many leave the H200 short of warps to hide latency: at
# `large`'s layer shape, 1 x 4K Sparse GQA (64 programs) went 16 -> 19 us and 1 x 128K
# (224) 39 -> 47 us against the whole tile's 4 warps, SWA at 16 x 4K (256) 10 -> 12 us;
# from 512 on it was as fast or faster (64 x 4K, 4,096 programs: 156 -> 90 us).
ONE_WARP_MIN_PROGRAMS = 512


def one_query_slots(tiles: QueryTiles, g: int, warps: int, programs: int) -> int:
    """Slots of the one-warp slice a part walk of `programs` programs runs per tile, or 0
    (the whole tile).

    The slice is one warp's 16 rows (16 // g slots, a one-warp launch). It applies when
    every tile holds one query, the walk launches at least ONE_WARP_MIN_PROGRAMS programs,
    the whole tile gives each of its `warps` warps 16 rows and g divides 16. The query's
    rows then sit at the same place in that warp's share as in the whole tile, so a
    one-warp program computes them alike (`test_attention_split`), in a quarter of the
    instructions (the decode walk is bound by instruction issue)."""
    if not tiles.host_rows or max(tiles.host_rows) != 1 or programs < ONE_WARP_MIN_PROGRAMS:
        return 0
    if MMA_WARP_ROWS % g or tiles.T * g < warps * MMA_WARP_ROWS:
        return 0
    sub = MMA_WARP_ROWS // g
    return sub if tiles.T % sub == 0 else 0


def splits_chunks(tiles: QueryTiles, hkv: int, chunk: int, n_chunks: int, g: int = 0) -> bool:
    """Walk the chunks in parallel when the tiles are decode-like (a quarter full at most,
    known on the host) and reach past one chunk, and either launch few programs (the
    bounds) or hold one query each with the part walk on one warp's rows (`g`: heads per
    KV group; 0, not known), which beat the single walk at every batch measured."""
    rows = tiles.host_rows
    if not rows or max(rows) * 4 > tiles.T or tiles.max_pos < chunk:
        return False
    programs = tiles.n_tiles * hkv
    warps = FORWARD_LAUNCH["num_warps"]
    if SPLIT_ONE_WARP and g and one_query_slots(tiles, g, warps, programs * n_chunks):
        return True
    return programs < SPLIT_BELOW_PROGRAMS and programs * n_chunks <= SPLIT_MAX_CHUNK_PROGRAMS
