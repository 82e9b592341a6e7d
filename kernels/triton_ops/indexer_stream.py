"""Sparse GQA indexer, streamed: the exact top-(k/B) selection without a score buffer.

`select_blocks` (indexer.py) writes every (query, group) row's fp32 block scores to a
buffer and ranks each row in a program of its own. At 128K that buffer is ~17 GB written
and read again, and a row fills an SM's registers, so its ~7 dependent counts run at low
occupancy. Here one program holds a query tile's rows (T positions x HKV groups: the rows
of one `_index_scores` program) and recomputes their scores chunk by chunk, on the tensor
cores, in each of a few passes over the tile's past blocks:
1. moments: per row the mean and spread of its scores and its smallest and largest key;
2. probe passes: per row P probes (keys) inside the row's bracket [lo, hi), each counted
   (how many of the row's keys are >= it) in the same pass. The first pass places them at
   the normal quantiles of counts around k (from the moments); later ones interpolate in
   the probit of the counts between the bracket's ends, and one probe always sits at the
   bracket's key midpoint, so a pass at least halves the bracket: 33 passes bound any row.
   A row whose bracket holds at most C keys collects them in that pass instead (into a
   per-row scratch of C keys) and ranks them at its end: its k-th key is then known. A
   row is resolved once a probe counts exactly k (select keys >= it) or its k-th key is
   known (a one-key bracket; ties at it are taken by lower block id). On the bench's
   `deep-92` rows the first probe pass leaves ~30 keys, so a tile takes two passes
   (`benchmarks/indexer_stream_passes.py`): four score products with the moments and
   the bitmap, where the buffered path takes one and writes and reads an fp32 buffer;
3. the final pass writes the bitmap (and, for the indexer KL, the ids ascending).

Invariants:
- The scores are `_index_scores`'s: the same tile shapes (T * HKV rows x NBT blocks), the
  same loads and the same `mma`, so every score is bitwise the buffered path's and the
  selection, an exact function of them, is the same set: the k highest keys, ties to the
  lower block id (tested against the buffered path and the fp64 reference).
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
from rlsys.kernels.triton_ops.common import check_device, interpreting, mma, next_pow2
from rlsys.kernels.triton_ops.indexer import (
    NBT,
    Selection,
    _order_key,
    _upper_z,
    _value_of,
)

PROBES = 8  # probes counted per pass: more narrow faster, each costs a compare per score
COLLECT = 64  # a bracket of at most this many keys is collected and ranked, not probed
# Compiled for sm_90 on the CPU box (Triton 3.9, `benchmarks/indexer_stream_registers.py`):
# 255 registers at 4 and 8 warps, spilling 1,200 / 272 bytes (ids off); the eight probes'
# counts alone take 255. Not yet run on a GPU: the launch is 8 warps until measured.
STREAM_WARPS = 8
MAX_PASSES = 34  # probe passes: the midpoint probe halves a 2^33-key bracket within 33
INT32_MIN = tl.constexpr(-2147483648)  # constexpr: read inside the kernel
INT32_MAX = tl.constexpr(2147483647)
# the first pass's target counts, as multiples of k: bracket the normal guess widely
FIRST_RATIOS = (0.75, 0.87, 0.93, 0.97, 1.03, 1.07, 1.15, 1.3)
# later passes' targets: k - 1/2 plus these fractions of the bracket's population
NEXT_FRACTIONS = (-0.3, -0.1, -0.03, 0.0, 0.03, 0.1, 0.3)


@triton.jit
def _tile_scores(
    qi, BK, bk_stride_r, bk_table, seq, bkt_stride, c0, nb,
    IDX: tl.constexpr, IDXP: tl.constexpr, NBT: tl.constexpr, BPP: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Scores (rows, NBT) of blocks [c0, c0 + NBT) and their ids: `_index_scores`'s loads
    and product (blocks from `nb` on are loaded as zeros and never read)."""
    d = tl.arange(0, IDXP)
    b = c0 + tl.arange(0, NBT)
    bneed = b < nb
    page_row = tl.load(bk_table + seq * bkt_stride + b // BPP, mask=bneed, other=0)
    bk = tl.load(
        BK + (page_row + b % BPP).to(tl.int64)[:, None] * bk_stride_r + d[None, :],
        mask=bneed[:, None] & (d < IDX)[None, :],
        other=0.0,
    )
    if UPCAST:
        bk = bk.to(tl.float32)
    return mma(qi, tl.trans(bk), PRECISION, UPCAST), b


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
def _stream_select(
    QI, BK, BITS, IDS, PASSES, SCRATCH,
    qi_stride_n, qi_stride_g, bk_stride_r, bits_stride_r, ids_stride_r,
    tile_seq, tile_slot0, tile_lo, tile_hi, tile_row,
    bk_table, bkt_stride,
    HKV: tl.constexpr, T: tl.constexpr, IDX: tl.constexpr, IDXP: tl.constexpr,
    NBT: tl.constexpr, BPP: tl.constexpr, BLK: tl.constexpr,
    KSEL: tl.constexpr, KSELP: tl.constexpr, NWO: tl.constexpr, P: tl.constexpr,
    C: tl.constexpr,
    R0: tl.constexpr, R1: tl.constexpr, R2: tl.constexpr, R3: tl.constexpr,
    R4: tl.constexpr, R5: tl.constexpr, R6: tl.constexpr, R7: tl.constexpr,
    F0: tl.constexpr, F1: tl.constexpr, F2: tl.constexpr, F3: tl.constexpr,
    F4: tl.constexpr, F5: tl.constexpr, F6: tl.constexpr,
    MAX_PASSES: tl.constexpr, WRITE_IDS: tl.constexpr, COUNT_PASSES: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One program per query tile: its T * HKV rows, every pass over their past blocks."""
    tile = tl.program_id(0)
    seq = tl.load(tile_seq + tile)
    slot0 = tl.load(tile_slot0 + tile)
    lo_pos = tl.load(tile_lo + tile)
    hi_pos = tl.load(tile_hi + tile)
    row0 = tl.load(tile_row + tile)
    r = tl.arange(0, T * HKV)
    qpos = slot0 + r // HKV
    g = r % HKV
    present = (qpos >= lo_pos) & (qpos < hi_pos)
    qrow = tl.where(present, row0 + qpos - lo_pos, 0).to(tl.int64)
    d = tl.arange(0, IDXP)
    qi = tl.load(
        QI + qrow[:, None] * qi_stride_n + g[:, None] * qi_stride_g + d[None, :],
        mask=present[:, None] & (d < IDX)[None, :],
        other=0.0,
    )
    if UPCAST:
        qi = qi.to(tl.float32)
    npast = tl.where(present, qpos // BLK, 0)
    nb = (hi_pos - 1) // BLK  # the blocks any row of the tile reads (`_index_scores`'s)
    out_row = qrow * HKV + g

    # 1. moments, and the bracket of keys [lo, hi): n_lo keys >= lo, n_hi keys >= hi
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
    active = npast > KSEL

    # 2. probe passes; a row whose bracket holds at most C keys collects them instead, and
    # takes its k-th key from them at the pass's end
    j = tl.arange(0, P)[None, :]
    cslot = tl.arange(0, C)[None, :]
    scratch = SCRATCH + (tile * (T * HKV) + r).to(tl.int64) * C
    passes = 0
    while (tl.max(active.to(tl.int32), axis=0) > 0) & (passes < MAX_PASSES):
        collect = active & (n_lo - n_hi <= C)
        search = active & ~collect
        if passes == 0:  # normal quantiles around k, from the moments
            ratio = tl.where(j == 0, R0, tl.where(j == 1, R1, tl.where(j == 2, R2, tl.where(
                j == 3, R3, tl.where(j == 4, R4, tl.where(j == 5, R5, tl.where(
                    j == 6, R6, R7)))))))  # fmt: skip
            target = tl.minimum(KSEL * ratio, n_f[:, None] - 0.5)
            z = _upper_z(target, n_f[:, None])
            guess = mu[:, None] + sigma[:, None] * z
        else:  # in the probit of the counts between the bracket's ends
            frac = tl.where(j == 0, F0, tl.where(j == 1, F1, tl.where(j == 2, F2, tl.where(
                j == 3, F3, tl.where(j == 4, F4, tl.where(j == 5, F5, F6))))))  # fmt: skip
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
        inside = (probe > lo[:, None]) & (probe < hi[:, None]) & (j < P - 1)
        if passes == 0:
            inside = (probe > lo[:, None]) & (probe < hi[:, None])
        # outside the bracket (or the last probe after the first pass): the key midpoint,
        # or points spread evenly in the bracket's keys
        even = lo[:, None] + (hi - lo)[:, None] * (j + 1) // (P + 1)
        probe = tl.where(inside, probe, tl.where(j == P - 1, mid, even))
        probe = tl.where(search[:, None], probe, lo[:, None])  # other rows: unused
        probe32 = tl.maximum(tl.minimum(probe, INT32_MAX), INT32_MIN).to(tl.int32)
        # the probes as eight per-row vectors, each counted at every chunk (P = 8)
        p0, p1 = _column(probe32, j, 0), _column(probe32, j, 1)
        p2, p3 = _column(probe32, j, 2), _column(probe32, j, 3)
        p4, p5 = _column(probe32, j, 4), _column(probe32, j, 5)
        p6, p7 = _column(probe32, j, 6), _column(probe32, j, 7)
        c0 = tl.zeros([T * HKV], tl.int32)
        c1, c2, c3, c4, c5, c6, c7 = c0, c0, c0, c0, c0, c0, c0
        n_cand = tl.zeros([T * HKV], tl.int32)
        any_collect = tl.max(collect.to(tl.int32), axis=0) > 0
        lo_c = tl.where(collect, lo, INT32_MAX).to(tl.int32)  # collect [lo, hi)
        hi_c = tl.where(collect, hi, INT32_MIN).to(tl.int64)
        for at in range(0, nb, NBT):
            key, b = _chunk_keys(
                qi, BK, bk_stride_r, bk_table, seq, bkt_stride, at, nb, npast,
                IDX, IDXP, NBT, BPP, UPCAST, PRECISION,
            )  # fmt: skip
            c0 += _at_least(key, p0)
            c1 += _at_least(key, p1)
            c2 += _at_least(key, p2)
            c3 += _at_least(key, p3)
            c4 += _at_least(key, p4)
            c5 += _at_least(key, p5)
            c6 += _at_least(key, p6)
            c7 += _at_least(key, p7)
            if any_collect:
                cand = (key >= lo_c[:, None]) & (key.to(tl.int64) < hi_c[:, None])
                slot = n_cand[:, None] + tl.cumsum(cand.to(tl.int32), axis=1) - 1
                tl.store(scratch[:, None] + slot, key, mask=cand)
                n_cand += tl.sum(cand.to(tl.int32), axis=1)
        counts = tl.where(j == 0, c0[:, None], tl.where(j == 1, c1[:, None], tl.where(
            j == 2, c2[:, None], tl.where(j == 3, c3[:, None], tl.where(
                j == 4, c4[:, None], tl.where(j == 5, c5[:, None], tl.where(
                    j == 6, c6[:, None], c7[:, None])))))))  # fmt: skip
        at_least = (counts >= KSEL) & (probe > lo[:, None]) & search[:, None]
        below = (counts < KSEL) & (probe < hi[:, None]) & search[:, None]
        lo = tl.maximum(lo, tl.max(tl.where(at_least, probe, INT32_MIN), axis=1))
        n_lo = tl.minimum(n_lo, tl.min(tl.where(at_least, counts, INT32_MAX), axis=1))
        hi = tl.minimum(hi, tl.min(tl.where(below, probe, INT32_MAX + 1), axis=1))
        n_hi_old = n_hi
        n_hi = tl.maximum(n_hi, tl.max(tl.where(below, counts, -1), axis=1))
        if any_collect:
            # the owed-th largest collected key: how many candidates beat / tie each one
            tl.debug_barrier()  # the candidates were stored by other threads
            mine = tl.load(scratch[:, None] + cslot, mask=cslot < n_cand[:, None], other=0)
            owed = KSEL - n_hi_old
            above = tl.zeros([T * HKV, C], tl.int32)
            at_or_above = tl.zeros([T * HKV, C], tl.int32)
            for i in range(0, C):
                other = tl.load(scratch + i, mask=collect & (i < n_cand), other=INT32_MIN)
                above += (other[:, None] > mine).to(tl.int32)
                at_or_above += (other[:, None] >= mine).to(tl.int32)
            is_kth = (
                (above < owed[:, None]) & (at_or_above >= owed[:, None]) & (cslot < n_cand[:, None])
            )
            kth = tl.max(tl.where(is_kth, mine, INT32_MIN), axis=1)
            n_above = tl.max(tl.where(is_kth, above, -1), axis=1)
            n_at = tl.max(tl.where(is_kth, at_or_above, -1), axis=1)
            lo = tl.where(collect, kth.to(tl.int64), lo)
            hi = tl.where(collect, kth.to(tl.int64) + 1, hi)
            n_lo = tl.where(collect, n_hi_old + n_at, n_lo)
            n_hi = tl.where(collect, n_hi_old + n_above, n_hi)
            tl.debug_barrier()  # read before the next pass stores over them
        active = search & (n_lo != KSEL) & (hi - lo > 1)
        passes += 1
    if COUNT_PASSES:
        tl.store(PASSES + tile, passes)

    # 3. the bitmap (and ids): keys >= lo; where lo is a tied k-th key (its bracket one key
    # wide, more keys at lo than owed), the lowest block ids of the ties
    lo32 = lo.to(tl.int32)
    every = npast <= KSEL  # a row of at most k blocks takes them all
    ranked = (n_lo != KSEL) & ~every  # ties at lo beyond what is owed: ranked by block id
    owed = KSEL - n_hi
    any_ranked = tl.max(ranked.to(tl.int32), axis=0) > 0
    ties = tl.zeros([T * HKV], tl.int32)
    n_sel = tl.zeros([T * HKV], tl.int32)
    for at in range(0, nb, NBT):
        key, b = _chunk_keys(
            qi, BK, bk_stride_r, bk_table, seq, bkt_stride, at, nb, npast,
            IDX, IDXP, NBT, BPP, UPCAST, PRECISION,
        )  # fmt: skip
        valid = b[None, :] < npast[:, None]
        sel = valid & ((key >= lo32[:, None]) | every[:, None])
        if any_ranked:  # rare: equal scores at a row's k-th
            tied = (key == lo32[:, None]) & ranked[:, None]
            rank = ties[:, None] + tl.cumsum(tied.to(tl.int32), axis=1)
            ties += tl.sum(tied.to(tl.int32), axis=1)
            sel = sel & ~(tied & (rank > owed[:, None]))
        shift = (b % 32).to(tl.uint32)
        for h in tl.static_range(NBT // 32):
            half = (b >= at + 32 * h) & (b < at + 32 * (h + 1))
            bits = tl.where(sel & half[None, :], tl.full([1, NBT], 1, tl.uint32) << shift, 0)
            word = at // 32 + h
            tl.store(
                BITS + out_row * bits_stride_r + word,
                tl.sum(bits, axis=1).to(tl.int32, bitcast=True),  # distinct bits: the sum ORs
                # compared as a vector: Triton 3.9's interpreter types scalar-bool &
                # vector-bool as int32, which it refuses as a mask
                mask=present & (r * 0 + word < NWO),
            )
        if WRITE_IDS:
            slot = n_sel[:, None] + tl.cumsum(sel.to(tl.int32), axis=1) - 1
            tl.store(
                IDS + out_row[:, None] * ids_stride_r + slot,
                b[None, :] + tl.zeros([T * HKV, NBT], tl.int32),
                mask=sel,
            )
            n_sel += tl.sum(sel.to(tl.int32), axis=1)
    # words past the tile's blocks, and ids past a row's selection
    w_done = (nb + NBT - 1) // NBT * (NBT // 32)
    for w0 in range(w_done, NWO, NBT // 32):
        w = w0 + tl.arange(0, NBT // 32)
        tl.store(
            BITS + out_row[:, None] * bits_stride_r + w[None, :],
            tl.zeros([T * HKV, NBT // 32], tl.int32),
            mask=present[:, None] & (w < NWO)[None, :],
        )
    if WRITE_IDS:
        k = tl.arange(0, KSELP)
        tl.store(
            IDS + out_row[:, None] * ids_stride_r + k[None, :],
            tl.full([T * HKV, KSELP], -1, tl.int32),
            mask=present[:, None] & (k[None, :] >= n_sel[:, None]) & (k < KSEL)[None, :],
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
    """`select_blocks`'s selection (the same ids and bitmap, see the module doc) in one
    launch and no score buffer. `passes`, an int32 (n_tiles,) tensor, receives each
    tile's probe passes (what the selection's cost scales with; a bench reads it)."""
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
    id_buf = out.ids if out.ids is not None else out.bits  # not written without ids
    pass_buf = passes if passes is not None else out.bits
    scratch = torch.empty(tiles.n_tiles * tiles.T * hkv * COLLECT, dtype=torch.int32, device=dev)
    ratios = {f"R{i}": r for i, r in enumerate(FIRST_RATIOS)}
    fractions = {f"F{i}": f for i, f in enumerate(NEXT_FRACTIONS)}
    _stream_select[(tiles.n_tiles,)](
        qi, block_keys, out.bits, id_buf, pass_buf, scratch,
        qi.stride(0), qi.stride(1), block_keys.stride(0), out.bits.stride(1),
        id_buf.stride(1),
        tiles.seq, tiles.slot0, tiles.lo, tiles.hi, tiles.row,
        bk_table.block_table, bk_table.block_table.stride(0),
        HKV=hkv, T=tiles.T, IDX=idx, IDXP=next_pow2(idx), NBT=NBT,
        BPP=bk_table.page_size, BLK=block, KSEL=topk_blocks, KSELP=next_pow2(topk_blocks),
        NWO=nw, P=PROBES, C=COLLECT, **ratios, **fractions, MAX_PASSES=MAX_PASSES,
        WRITE_IDS=ids, COUNT_PASSES=passes is not None,
        UPCAST=interpreting(), PRECISION=precision,
        num_warps=STREAM_WARPS,
    )  # fmt: skip
    return out
