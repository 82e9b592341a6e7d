"""Sparse GQA indexer, streamed: the exact top-(k/B) selection without a score buffer.

`select_blocks` (indexer.py) writes every (query, group) row's fp32 block scores to a
buffer and ranks each row in a program of its own. At 128K that buffer is ~17 GB written
and read again, and a row fills an SM's registers, so its ~7 dependent counts run at low
occupancy. Here a program holds a query tile's rows (T positions x HKV groups: the rows of
one `_index_scores` program) and recomputes their scores chunk by chunk, on the tensor
cores, in each pass over the tile's past blocks. Three launches, one per step, so that
each kernel holds only its own step's registers (one kernel of all three compiled to 255
registers and spilled); a row's state between them is four int32s (STATE):
1. `_stream_bracket`: a moments pass (per row the mean and spread of its scores, its
   smallest and largest key), then probe passes: per row P probes (keys) inside its
   bracket [lo, hi), counted (how many of the row's keys are >= each) in one pass. The
   first pass places them at the normal quantiles of counts around k; later ones
   interpolate in the probit of the counts between the bracket's ends, and one sits at the
   bracket's key midpoint, so a pass at least halves the bracket (33 bound any row). A row
   is done when a probe counts exactly k, its bracket is one key wide, or the bracket
   holds at most C keys;
2. `_stream_collect`: rows whose bracket still holds 2..C keys store them (a per-row
   scratch of C) in one pass and rank them: the k-th key and the counts above and at it;
3. `_stream_bits`: the bitmap: keys > the k-th, and keys equal to it unless more tie at it
   than are owed (rare: equal fp32 scores); then `_stream_ties` adds the owed ties with
   the lowest block ids (a tile without such rows ends at once), and, for the indexer KL,
   `_bits_to_ids` writes the ids ascending.
On the bench's `deep-92` rows (clustered index queries) the first probe pass leaves ~40
keys: four score products per tile in all (`benchmarks/indexer_stream_passes.py`), where
the buffered path takes one and writes and reads its fp32 buffer.

Invariants:
- The scores are `_index_scores`'s: both kernels compute them with `indexer._tile_rows`
  and `indexer._tile_scores` (T * HKV rows x NBT blocks, the same loads and `mma`), so
  every score is bitwise the buffered path's and the selection, an exact function of
  them, is the same set: the k highest keys, ties to the lower block id (tested against
  the buffered path and the fp64 reference).
- The probes decide only how many passes a row takes, never what it selects: any probe
  strictly inside the bracket keeps the bracket's counts exact.
- Every word of a row's bitmap is written (zeros past its blocks), as the buffered path's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from rlsys.kernels.attention_plan import PagedKV, QueryTiles
from rlsys.kernels.triton_ops.common import check_device, interpreting, next_pow2
from rlsys.kernels.triton_ops.indexer import (
    NBT,
    Selection,
    _count,
    _inclusive_rank,
    _order_key,
    _tile_places,
    _tile_rows,
    _tile_scores,
    _value_of,
    _z_of_tail,
)

PROBES = 4  # probes counted per pass (the kernel is written for 4: `p0`..`p3`)
COLLECT = 64  # a bracket of at most this many keys is collected and ranked, not probed
# Warps of every streamed kernel: 4, as `_index_scores` launches. Compiled for sm_90 on the
# CPU box (Triton 3.9), 4 warps give every kernel the product's instruction
# (HGMMA.64x64x8.F32.TF32); at 8 warps the collect kernel (188 registers there, 255 and
# 48 bytes spilled at 4) split it into 64x32 halves: not shown to round alike, and a
# collected key must be the same number the other passes counted. On the H100 (4 warps)
# the selection is bitwise the buffered one at 32K and 128K, but no faster: 3.71 / 45.2 ms
# against 2.72 / 45.8, the collect kernel 18.0 ms at 128K (BENCHMARKS, forward walk).
STREAM_WARPS = 4
MAX_PASSES = 34  # probe passes: the midpoint probe halves a 2^33-key bracket within 33
INT32_MIN = tl.constexpr(-2147483648)  # constexpr: read inside the kernels
INT32_MAX = tl.constexpr(2147483647)
# the first pass's target counts, as multiples of k: around the normal guess
FIRST_RATIOS = (0.9, 0.96, 1.04, 1.1)
# later passes' targets: k - 1/2 plus these fractions of the bracket's population
NEXT_FRACTIONS = (-0.1, 0.0, 0.1)


@triton.jit
def _upper_z(c, n):
    """The z with P(Z > z) = c / n for a standard normal Z (c clamped to [0.5, n - 0.5]),
    by Abramowitz-Stegun 26.2.23 (|error| < 4.5e-4) on the exact log: the first pass's
    probes sit ~20 counts either side of k at 128K, and the buffered search's approximate
    log (`indexer._upper_z`, within 0.09 in log2) moves a tail quantile about that much.
    Computed per row and probe, never per score. Only the guesses use it."""
    p = tl.fdiv(tl.minimum(tl.maximum(c, 0.5), n - 0.5), n, ieee_rounding=False)
    q = tl.minimum(p, 1.0 - p)
    return _z_of_tail(tl.sqrt(-2.0 * tl.log(q)), p)


@triton.jit
def _column(x, j, p: tl.constexpr):
    """Column p of a (rows, P) tensor, as a per-row vector."""
    return tl.sum(tl.where(j == p, x, 0), axis=1)


@triton.jit
def _at_least(key, probe):
    """Per row: how many of its (rows, NBT) keys are >= its probe (a per-row vector)."""
    return tl.sum((key >= probe[:, None]).to(tl.int32), axis=1)


@triton.jit
def _chunk_keys(
    qi, BK, bk_stride_r, bk_table, seq, bkt_stride, at, nb, npast,
    IDX: tl.constexpr, IDXP: tl.constexpr, NBT: tl.constexpr, BPP: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Order keys (rows, NBT) of blocks [at, at + NBT) (a row's blocks past its own hold
    INT32_MIN, below every probe), and the block ids."""
    s, b = _tile_scores(
        qi, BK, bk_stride_r, bk_table, seq, bkt_stride, at, nb,
        IDX, IDXP, NBT, BPP, UPCAST, PRECISION,
    )  # fmt: skip
    valid = b[None, :] < npast[:, None]
    return tl.where(valid, _order_key(s), INT32_MIN), b


@triton.jit
def _stream_bracket(
    QI, BK, STATE,
    qi_stride_n, qi_stride_g, bk_stride_r,
    tile_seq, tile_slot0, tile_lo, tile_hi, tile_row,
    bk_table, bkt_stride,
    HKV: tl.constexpr, T: tl.constexpr, IDX: tl.constexpr, IDXP: tl.constexpr,
    NBT: tl.constexpr, BPP: tl.constexpr, BLK: tl.constexpr, KSEL: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    PASSES, P: tl.constexpr, C: tl.constexpr,
    R0: tl.constexpr, R1: tl.constexpr, R2: tl.constexpr, R3: tl.constexpr,
    F0: tl.constexpr, F1: tl.constexpr, F2: tl.constexpr,
    MAX_PASSES: tl.constexpr, COUNT_PASSES: tl.constexpr,
):  # fmt: skip
    """Step 1: each row's bracket [lo, hi) of keys (n_lo keys >= lo, n_hi >= hi), narrowed
    until the row is done; STATE[row] = (lo, hi - 1, n_lo, n_hi). PASSES[tile]: the probe
    passes (with COUNT_PASSES)."""
    seq, qi, npast, nb, out_row, present, r = _tile_rows(
        QI, qi_stride_n, qi_stride_g, tile_seq, tile_slot0, tile_lo, tile_hi, tile_row,
        HKV, T, IDX, IDXP, BLK, UPCAST,
    )  # fmt: skip
    s1 = tl.zeros([T * HKV], tl.float32)
    s2 = tl.zeros([T * HKV], tl.float32)
    kmin = tl.full([T * HKV], INT32_MAX, tl.int32)
    kmax = tl.full([T * HKV], INT32_MIN, tl.int32)
    for at in range(0, nb, NBT):
        s, b = _tile_scores(
            qi, BK, bk_stride_r, bk_table, seq, bkt_stride, at, nb,
            IDX, IDXP, NBT, BPP, UPCAST, PRECISION,
        )  # fmt: skip
        valid = b[None, :] < npast[:, None]
        sv = tl.where(valid, s, 0.0)
        s1 += tl.sum(sv, axis=1)
        s2 += tl.sum(sv * sv, axis=1)
        key = _order_key(s)
        kmin = tl.minimum(kmin, tl.min(tl.where(valid, key, INT32_MAX), axis=1))
        kmax = tl.maximum(kmax, tl.max(tl.where(valid, key, INT32_MIN), axis=1))
    n_f = tl.maximum(npast, 1).to(tl.float32)
    mu = s1 / n_f
    sigma = tl.sqrt(tl.maximum(s2 / n_f - mu * mu, 0.0)) + 1e-30
    lo = kmin.to(tl.int64)
    hi = kmax.to(tl.int64) + 1
    n_lo = npast
    n_hi = npast * 0
    # a row of at most k blocks takes them all; one of at most C is collected whole
    search = (npast > KSEL) & (npast > C)
    j = tl.arange(0, P)[None, :]
    passes = 0
    while (tl.max(search.to(tl.int32), axis=0) > 0) & (passes < MAX_PASSES):
        if passes == 0:  # normal quantiles around k, from the moments
            ratio = tl.where(j == 0, R0, tl.where(j == 1, R1, tl.where(j == 2, R2, R3)))
            target = tl.minimum(KSEL * ratio, n_f[:, None] - 0.5)
            z = _upper_z(target, n_f[:, None])
            guess = mu[:, None] + sigma[:, None] * z
        else:  # in the probit of the counts between the bracket's ends
            frac = tl.where(j == 0, F0, tl.where(j == 1, F1, F2))
            pop = (n_lo - n_hi).to(tl.float32)[:, None]
            target = KSEL - 0.5 + pop * frac
            z_lo = _upper_z(n_lo.to(tl.float32)[:, None], n_f[:, None])
            z_hi = _upper_z(n_hi.to(tl.float32)[:, None], n_f[:, None])
            z = _upper_z(target, n_f[:, None])
            v_lo = _value_of(lo)[:, None]
            v_hi = _value_of(hi - 1)[:, None]
            guess = v_lo + (v_hi - v_lo) * tl.fdiv(z - z_lo, z_hi - z_lo, ieee_rounding=False)
        probe = _order_key(guess).to(tl.int64)
        mid = lo[:, None] + (hi - lo)[:, None] // 2
        inside = (probe > lo[:, None]) & (probe < hi[:, None]) & ((j < P - 1) | (passes == 0))
        # outside the bracket (or the last probe after the first pass): the key midpoint,
        # or points spread evenly in the bracket's keys
        even = lo[:, None] + (hi - lo)[:, None] * (j + 1) // (P + 1)
        probe = tl.where(inside, probe, tl.where(j == P - 1, mid, even))
        probe = tl.where(search[:, None], probe, lo[:, None])  # other rows: unused
        probe32 = tl.maximum(tl.minimum(probe, INT32_MAX), INT32_MIN).to(tl.int32)
        # four per-row vectors, each counted at every chunk (eight took 255 registers)
        p0, p1 = _column(probe32, j, 0), _column(probe32, j, 1)
        p2, p3 = _column(probe32, j, 2), _column(probe32, j, 3)
        c0 = tl.zeros([T * HKV], tl.int32)
        c1, c2, c3 = c0, c0, c0
        for at in range(0, nb, NBT):
            key, b = _chunk_keys(
                qi, BK, bk_stride_r, bk_table, seq, bkt_stride, at, nb, npast,
                IDX, IDXP, NBT, BPP, UPCAST, PRECISION,
            )  # fmt: skip
            c0 += _at_least(key, p0)
            c1 += _at_least(key, p1)
            c2 += _at_least(key, p2)
            c3 += _at_least(key, p3)
        counts = tl.where(
            j == 0,
            c0[:, None],
            tl.where(j == 1, c1[:, None], tl.where(j == 2, c2[:, None], c3[:, None])),
        )
        at_least = (counts >= KSEL) & (probe > lo[:, None]) & search[:, None]
        below = (counts < KSEL) & (probe < hi[:, None]) & search[:, None]
        lo = tl.maximum(lo, tl.max(tl.where(at_least, probe, INT32_MIN), axis=1))
        n_lo = tl.minimum(n_lo, tl.min(tl.where(at_least, counts, INT32_MAX), axis=1))
        hi = tl.minimum(hi, tl.min(tl.where(below, probe, INT32_MAX + 1), axis=1))
        n_hi = tl.maximum(n_hi, tl.max(tl.where(below, counts, -1), axis=1))
        search = search & (n_lo != KSEL) & (hi - lo > 1) & (n_lo - n_hi > C)
        passes += 1
    if COUNT_PASSES:
        tl.store(PASSES + tl.program_id(0), passes)
    state = STATE + out_row * 4
    tl.store(state, lo.to(tl.int32), mask=present)
    tl.store(state + 1, (hi - 1).to(tl.int32), mask=present)
    tl.store(state + 2, n_lo, mask=present)
    tl.store(state + 3, n_hi, mask=present)


@triton.jit
def _stream_collect(
    QI, BK, STATE,
    qi_stride_n, qi_stride_g, bk_stride_r,
    tile_seq, tile_slot0, tile_lo, tile_hi, tile_row,
    bk_table, bkt_stride,
    HKV: tl.constexpr, T: tl.constexpr, IDX: tl.constexpr, IDXP: tl.constexpr,
    NBT: tl.constexpr, BPP: tl.constexpr, BLK: tl.constexpr, KSEL: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    SCRATCH, C: tl.constexpr,
):  # fmt: skip
    """Step 2: rows past k blocks whose bracket holds 2..C keys (not yet exact): the keys
    stored in one pass (SCRATCH: C per row of the tile), then the owed-th largest of them
    found by counting, per candidate, its row's candidates above and at it. STATE then
    holds the k-th key as a one-key bracket."""
    seq, qi, npast, nb, out_row, present, r = _tile_rows(
        QI, qi_stride_n, qi_stride_g, tile_seq, tile_slot0, tile_lo, tile_hi, tile_row,
        HKV, T, IDX, IDXP, BLK, UPCAST,
    )  # fmt: skip
    state = STATE + out_row * 4
    lo = tl.load(state, mask=present, other=0)
    hi = tl.load(state + 1, mask=present, other=0).to(tl.int64) + 1
    n_lo = tl.load(state + 2, mask=present, other=0)
    n_hi = tl.load(state + 3, mask=present, other=0)
    collect = present & (npast > KSEL) & (n_lo != KSEL) & (hi - lo > 1)
    if tl.max(collect.to(tl.int32), axis=0) > 0:
        scratch = SCRATCH + (tl.program_id(0) * (T * HKV) + r).to(tl.int64) * C
        lo_c = tl.where(collect, lo, INT32_MAX)
        hi_c = tl.where(collect, hi, INT32_MIN)
        n_cand = tl.zeros([T * HKV], tl.int32)
        for at in range(0, nb, NBT):
            key, b = _chunk_keys(
                qi, BK, bk_stride_r, bk_table, seq, bkt_stride, at, nb, npast,
                IDX, IDXP, NBT, BPP, UPCAST, PRECISION,
            )  # fmt: skip
            cand = (key >= lo_c[:, None]) & (key.to(tl.int64) < hi_c[:, None])
            slot = n_cand[:, None] + tl.cumsum(cand.to(tl.int32), axis=1) - 1
            # (a bracket holds at most C keys: the bound only keeps a broken one in its row)
            tl.store(scratch[:, None] + slot, key, mask=cand & (slot < C))
            n_cand += tl.sum(cand.to(tl.int32), axis=1)
        tl.debug_barrier()  # the candidates were stored by other threads
        cslot = tl.arange(0, C)[None, :]
        held = cslot < n_cand[:, None]
        mine = tl.load(scratch[:, None] + cslot, mask=held, other=0)
        owed = KSEL - n_hi
        kth = tl.full([T * HKV], INT32_MIN, tl.int32)
        n_above = tl.zeros([T * HKV], tl.int32)
        n_at = tl.zeros([T * HKV], tl.int32)
        for i in range(0, C):
            one = tl.load(scratch + i, mask=collect & (i < n_cand), other=0)
            above = tl.sum((held & (mine > one[:, None])).to(tl.int32), axis=1)
            at_or_above = tl.sum((held & (mine >= one[:, None])).to(tl.int32), axis=1)
            hit = (i < n_cand) & (above < owed) & (at_or_above >= owed)
            kth = tl.where(hit, one, kth)
            n_above = tl.where(hit, above, n_above)
            n_at = tl.where(hit, at_or_above, n_at)
        tl.store(state, kth, mask=collect)
        tl.store(state + 1, kth, mask=collect)
        tl.store(state + 2, n_hi + n_at, mask=collect)
        tl.store(state + 3, n_hi + n_above, mask=collect)


@triton.jit
def _stream_bits(
    QI, BK, STATE,
    qi_stride_n, qi_stride_g, bk_stride_r,
    tile_seq, tile_slot0, tile_lo, tile_hi, tile_row,
    bk_table, bkt_stride,
    HKV: tl.constexpr, T: tl.constexpr, IDX: tl.constexpr, IDXP: tl.constexpr,
    NBT: tl.constexpr, BPP: tl.constexpr, BLK: tl.constexpr, KSEL: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BITS, bits_stride_r, NWO: tl.constexpr,
):  # fmt: skip
    """Step 3: the bitmap: keys >= the row's lo, or > it where more keys tie at lo than are
    owed (`_stream_ties` adds those); every block of a row of at most k; zeros past."""
    seq, qi, npast, nb, out_row, present, r = _tile_rows(
        QI, qi_stride_n, qi_stride_g, tile_seq, tile_slot0, tile_lo, tile_hi, tile_row,
        HKV, T, IDX, IDXP, BLK, UPCAST,
    )  # fmt: skip
    state = STATE + out_row * 4
    lo32 = tl.load(state, mask=present, other=0)
    n_lo = tl.load(state + 2, mask=present, other=0)
    every = npast <= KSEL  # a row of at most k blocks takes them all
    ranked = (n_lo != KSEL) & ~every
    for at in range(0, nb, NBT):
        key, b = _chunk_keys(
            qi, BK, bk_stride_r, bk_table, seq, bkt_stride, at, nb, npast,
            IDX, IDXP, NBT, BPP, UPCAST, PRECISION,
        )  # fmt: skip
        valid = b[None, :] < npast[:, None]
        above = (key > lo32[:, None]) | ((key == lo32[:, None]) & ~ranked[:, None])
        _store_words(BITS, out_row, bits_stride_r, at, b, valid & (above | every[:, None]),
                     present, r, NBT, NWO, False)  # fmt: skip
    w_done = (nb + NBT - 1) // NBT * (NBT // 32)
    for w0 in range(w_done, NWO, NBT // 32):
        w = w0 + tl.arange(0, NBT // 32)
        tl.store(
            BITS + out_row[:, None] * bits_stride_r + w[None, :],
            tl.zeros([T * HKV, NBT // 32], tl.int32),
            mask=present[:, None] & (w < NWO)[None, :],
        )


@triton.jit
def _store_words(BITS, out_row, bits_stride_r, at, b, sel, present, r,
                 NBT: tl.constexpr, NWO: tl.constexpr, OR: tl.constexpr):  # fmt: skip
    """Each row's bitmap words of blocks [at, at + NBT) from `sel` (rows, NBT); with `OR`,
    added to the words already there."""
    shift = (b % 32).to(tl.uint32)
    for h in tl.static_range(NBT // 32):
        half = (b >= at + 32 * h) & (b < at + 32 * (h + 1))
        bits = tl.where(sel & half[None, :], tl.full([1, NBT], 1, tl.uint32) << shift, 0)
        word = tl.sum(bits, axis=1).to(tl.int32, bitcast=True)  # distinct bits: the sum ORs
        # compared as a vector: Triton 3.9's interpreter types scalar-bool & vector-bool as
        # int32, which it refuses as a mask
        mask = present & (r * 0 + at // 32 + h < NWO)
        ptr = BITS + out_row * bits_stride_r + at // 32 + h
        if OR:
            word = word | tl.load(ptr, mask=mask, other=0)
        tl.store(ptr, word, mask=mask)


@triton.jit
def _stream_ties(
    QI, BK, STATE,
    qi_stride_n, qi_stride_g, bk_stride_r,
    tile_seq, tile_slot0, tile_lo, tile_hi, tile_row,
    bk_table, bkt_stride,
    HKV: tl.constexpr, T: tl.constexpr, IDX: tl.constexpr, IDXP: tl.constexpr,
    NBT: tl.constexpr, BPP: tl.constexpr, BLK: tl.constexpr, KSEL: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BITS, bits_stride_r, NWO: tl.constexpr,
):  # fmt: skip
    """Rows with a tied k-th key (rare: equal fp32 scores): the owed ties with the lowest
    block ids, added to the bitmap `_stream_bits` wrote. A tile without such rows reads
    its rows' state and ends."""
    qpos, present, qrow, _, r = _tile_places(tile_slot0, tile_lo, tile_hi, tile_row, HKV, T)
    state = STATE + (qrow * HKV + r % HKV) * 4
    n_lo = tl.load(state + 2, mask=present, other=KSEL)
    ranked = present & (qpos // BLK > KSEL) & (n_lo != KSEL)
    if tl.max(ranked.to(tl.int32), axis=0) > 0:
        seq, qi, npast, nb, out_row, present, r = _tile_rows(
            QI, qi_stride_n, qi_stride_g, tile_seq, tile_slot0, tile_lo, tile_hi, tile_row,
            HKV, T, IDX, IDXP, BLK, UPCAST,
        )  # fmt: skip
        kth = tl.load(state, mask=ranked, other=0)
        owed = KSEL - tl.load(state + 3, mask=ranked, other=0)
        ties = tl.zeros([T * HKV], tl.int32)
        for at in range(0, nb, NBT):
            key, b = _chunk_keys(
                qi, BK, bk_stride_r, bk_table, seq, bkt_stride, at, nb, npast,
                IDX, IDXP, NBT, BPP, UPCAST, PRECISION,
            )  # fmt: skip
            tied = (key == kth[:, None]) & (b[None, :] < npast[:, None]) & ranked[:, None]
            rank = ties[:, None] + tl.cumsum(tied.to(tl.int32), axis=1)
            ties += tl.sum(tied.to(tl.int32), axis=1)
            _store_words(BITS, out_row, bits_stride_r, at, b, tied & (rank <= owed[:, None]),
                         ranked, r, NBT, NWO, True)  # fmt: skip


@triton.jit
def _bits_to_ids(
    BITS, IDS, bits_stride_r, ids_stride_r,
    NWO: tl.constexpr, WB: tl.constexpr, KSEL: tl.constexpr, KSELP: tl.constexpr,
):  # fmt: skip
    """One program per (query, group) row: the ids of its bitmap's set bits, ascending, -1
    padded to KSEL (the indexer KL's input)."""
    row = tl.program_id(0).to(tl.int64)
    bit = tl.arange(0, 32)
    w = tl.arange(0, WB)
    n_sel = 0
    for w0 in range(0, NWO, WB):
        words = tl.load(BITS + row * bits_stride_r + w0 + w, mask=w0 + w < NWO, other=0)
        on = ((words[:, None] >> bit[None, :]) & 1) == 1
        slot = n_sel + _inclusive_rank(on) - 1
        ids = (w0 + w)[:, None] * 32 + bit[None, :]
        tl.store(IDS + row * ids_stride_r + slot, ids, mask=on & (slot < KSEL))
        n_sel += _count(on)
    k = tl.arange(0, KSELP)
    tl.store(
        IDS + row * ids_stride_r + k,
        tl.full([KSELP], -1, tl.int32),
        mask=(k >= n_sel) & (k < KSEL),
    )


def select_blocks_streamed(
    qi: Tensor,
    block_keys: Tensor,
    tiles: QueryTiles,
    bk_table: PagedKV,
    *,
    topk_blocks: int,
    block: int,
    precision: str = "ieee",
    ids: bool = True,
    passes: Tensor | None = None,
) -> Selection:
    """`select_blocks`'s selection (the same ids and bitmap, see the module doc) without a
    score buffer, in four launches (five with `ids`). `passes`, an int32 (n_tiles,)
    tensor, receives each tile's probe passes (a bench reads it)."""
    check_device(qi, block_keys)
    n, hkv, idx = qi.shape
    dev = qi.device
    nw = next_pow2(tiles.max_pos // block, at_least=32) // 32
    out = Selection(
        torch.empty(n, hkv, topk_blocks, dtype=torch.int32, device=dev) if ids else None,
        torch.empty(n, hkv, nw, dtype=torch.int32, device=dev),
    )
    if n == 0 or tiles.n_tiles == 0:
        return out
    state = torch.empty(n * hkv * 4, dtype=torch.int32, device=dev)
    scratch = torch.empty(tiles.n_tiles * tiles.T * hkv * COLLECT, dtype=torch.int32, device=dev)
    common = (
        qi, block_keys, state, qi.stride(0), qi.stride(1), block_keys.stride(0),
        tiles.seq, tiles.slot0, tiles.lo, tiles.hi, tiles.row,
        bk_table.block_table, bk_table.block_table.stride(0),
    )  # fmt: skip
    shape = {
        "HKV": hkv, "T": tiles.T, "IDX": idx, "IDXP": next_pow2(idx), "NBT": NBT,
        "BPP": bk_table.page_size, "BLK": block, "KSEL": topk_blocks,
        "UPCAST": interpreting(), "PRECISION": precision,
    }  # fmt: skip
    grid = (tiles.n_tiles,)
    _stream_bracket[grid](
        *common, PASSES=passes if passes is not None else state, **shape, P=PROBES, C=COLLECT,
        **{f"R{i}": r for i, r in enumerate(FIRST_RATIOS)},
        **{f"F{i}": f for i, f in enumerate(NEXT_FRACTIONS)},
        MAX_PASSES=MAX_PASSES, COUNT_PASSES=passes is not None,
        num_warps=STREAM_WARPS,
    )  # fmt: skip
    _stream_collect[grid](*common, SCRATCH=scratch, **shape, C=COLLECT, num_warps=STREAM_WARPS)
    bits = {"BITS": out.bits, "bits_stride_r": out.bits.stride(1), "NWO": nw}
    _stream_bits[grid](*common, **bits, **shape, num_warps=STREAM_WARPS)
    _stream_ties[grid](*common, **bits, **shape, num_warps=STREAM_WARPS)
    if out.ids is not None:
        _bits_to_ids[(n * hkv,)](
            out.bits, out.ids, out.bits.stride(1), out.ids.stride(1),
            NWO=nw, WB=min(64, next_pow2(nw, at_least=1)), KSEL=topk_blocks,
            KSELP=next_pow2(topk_blocks),
        )  # fmt: skip
    return out
