"""Sparse GQA indexer: block scores, exact top-(k/B) selection, and the union step lists.

Per query (position t) and KV group g, the score of a complete past block b < t // B is
`qi[t, g] . block_key[b]` (fp32 keys). The selection is the k/B highest scores (all past
blocks when there are fewer), ties broken toward the lower block id, so it is one exact
function of the scores: no batch, chunk or page placement can change it.

Kernels:
- `_index_scores`: one program per (query tile, tile of NBT blocks); M = T * Hkv rows
  (`_tile_rows`, `_tile_scores`: the streamed selection, `indexer_stream.py`, computes
  its scores with these same two helpers, so its scores are these bitwise).
  Scores go to a (rows, NBP) fp32 buffer that covers ONE chunk of queries at a time
  (`select_blocks` walks the queries in chunks), so no L x L/B matrix ever exists.
- `_topk_select`: one program per (query, group) row, scores held in registers (no sort,
  no copy): rows of up to `rank_max` blocks rank every block against all others at once;
  longer rows search the k-th largest order-preserving integer image of the fp32 scores
  (`_kth_key`: probes interpolated in the counts' probit, then halving; it stops at a probe
  that counts exactly k). All select the same set. Emits a bitmap (one bit per block) that
  the attention kernels test per row and, where the indexer KL needs them, the selected ids
  ascending (-1 padded).
The union step lists (which aligned key steps a query tile must visit) are built here too,
with torch sorting on small per-chunk tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from rlsys.kernels.attention_plan import PagedKV, QueryTiles
from rlsys.kernels.triton_ops import pdl
from rlsys.kernels.triton_ops.common import check_device, interpreting, mma, next_pow2

SCORE_CHUNK_BYTES = 256 * 2**20  # score buffer per chunk of queries
NBT = 64  # blocks per score program
SYNC_FREE_IDS = 1 << 24  # union id buffers up to this size are allocated without a sync
PREFIX_MAX = 4096  # (tile, group)s up to which the write pass sums the counts before it
# a top-k row's blocks per thread (its warps: 4 to 32): 64 was 4-5% faster than 32 at 128K
# on an H100, 16 and 8 slower, 128 no better
SELECT_PER_THREAD = 64


@triton.jit
def _tile_places(
    tile_slot0, tile_lo, tile_hi, tile_row, HKV: tl.constexpr, T: tl.constexpr
):  # fmt: skip
    """Where this program's query tile's rows are (M = T * HKV rows: position
    slot0 + r // HKV, group r % HKV): positions, presence, query rows, the tile's end
    position, and r; nothing of the queries themselves is loaded."""
    tile = tl.program_id(0)
    slot0 = tl.load(tile_slot0 + tile)
    lo_pos = tl.load(tile_lo + tile)
    hi_pos = tl.load(tile_hi + tile)
    row0 = tl.load(tile_row + tile)
    r = tl.arange(0, T * HKV)
    qpos = slot0 + r // HKV
    present = (qpos >= lo_pos) & (qpos < hi_pos)
    qrow = tl.where(present, row0 + qpos - lo_pos, 0).to(tl.int64)
    return qpos, present, qrow, hi_pos, r


@triton.jit
def _tile_rows(
    QI, qi_stride_n, qi_stride_g, tile_seq, tile_slot0, tile_lo, tile_hi, tile_row,
    HKV: tl.constexpr, T: tl.constexpr, IDX: tl.constexpr, IDXP: tl.constexpr,
    BLK: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """This program's query tile (`_tile_places`): its sequence, the rows' index queries,
    complete past blocks per row, the blocks any row reads (nb), output rows (query row *
    HKV + group), presence, and r."""
    seq = tl.load(tile_seq + tl.program_id(0))
    qpos, present, qrow, hi_pos, r = _tile_places(tile_slot0, tile_lo, tile_hi, tile_row, HKV, T)
    g = r % HKV
    d = tl.arange(0, IDXP)
    qi = tl.load(
        QI + qrow[:, None] * qi_stride_n + g[:, None] * qi_stride_g + d[None, :],
        mask=present[:, None] & (d < IDX)[None, :],
        other=0.0,
    )
    if UPCAST:
        qi = qi.to(tl.float32)
    npast = tl.where(present, qpos // BLK, 0)
    nb = (hi_pos - 1) // BLK  # the blocks any row of the tile reads
    return seq, qi, npast, nb, qrow * HKV + g, present, r


@triton.jit
def _tile_scores(
    qi, BK, bk_stride_r, bk_table, seq, bkt_stride, c0, nb,
    IDX: tl.constexpr, IDXP: tl.constexpr, NBT: tl.constexpr, BPP: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Scores (rows, NBT) of blocks [c0, c0 + NBT) and their ids: the one product both
    selections use (`_index_scores`, the streamed kernels); blocks from `nb` on are loaded
    as zeros and never read."""
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
def _index_scores(
    QI, BK, S,
    qi_stride_n, qi_stride_g, bk_stride_r, s_stride_r,
    tile_seq, tile_slot0, tile_lo, tile_hi, tile_row,
    bk_table, bkt_stride,
    row_base,
    HKV: tl.constexpr, T: tl.constexpr, IDX: tl.constexpr, IDXP: tl.constexpr,
    NBT: tl.constexpr, BPP: tl.constexpr, BLK: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl.wait_prior(PDL)
    pdl.release_next(PDL)
    seq, qi, npast, nb, out_row, present, r = _tile_rows(
        QI, qi_stride_n, qi_stride_g, tile_seq, tile_slot0, tile_lo, tile_hi, tile_row,
        HKV, T, IDX, IDXP, BLK, UPCAST,
    )  # fmt: skip
    s, b = _tile_scores(
        qi, BK, bk_stride_r, bk_table, seq, bkt_stride, tl.program_id(1) * NBT, nb,
        IDX, IDXP, NBT, BPP, UPCAST, PRECISION,
    )  # fmt: skip
    tl.store(
        S + (out_row - row_base * HKV)[:, None] * s_stride_r + b[None, :],
        s,
        mask=present[:, None] & (b[None, :] < npast[:, None]),
    )


@triton.jit
def _count(m):
    """How many entries of a (NW, 32) mask are set: one flat sum (the order of an integer
    sum is free), so a thread adds its own entries before any shuffle; summing a word's 32
    bits first cost a shuffle tree per word."""
    return tl.sum(tl.reshape(m.to(tl.int32), (m.shape[0] * m.shape[1],)), 0)


@triton.jit
def _inclusive_rank(m):
    """Per entry of a (NW, 32) mask in block order (word-major): the set entries up to and
    including it. Two short scans (over a word's 32 bits, over the NW word counts) instead
    of one over the whole row."""
    ones = m.to(tl.int32)
    per_word = tl.sum(ones, axis=1)
    before = tl.cumsum(per_word, axis=0) - per_word
    return before[:, None] + tl.cumsum(ones, axis=1)


@triton.jit
def _value_of(k):
    """The fp32 whose order-preserving integer image (`_order_key`) is the int64 scalar k."""
    bits = tl.where(k >= 0, k, k ^ 0x7FFFFFFF)
    return bits.to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _order_key(x):
    """Order-preserving int32 image of fp32 values: a < b as keys iff a < b as numbers, and
    -0.0 < +0.0 (the flipped magnitude bits of negatives; positives as they are)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _upper_z(c, n):
    """The z with P(Z > z) = c / n for a standard normal Z (c clamped to [0.5, n - 0.5]): a
    row's count above a value, as the value would sit in a normal row (Abramowitz-Stegun
    26.2.23, on an approximate log). Only the search's guesses use it."""
    p = tl.fdiv(tl.minimum(tl.maximum(c, 0.5), n - 0.5), n, ieee_rounding=False)
    q = tl.minimum(p, 1.0 - p)
    # log2 q read off its bits (exponent + mantissa - 1, within 0.09): a guess needs no more,
    # and the exact log cost more per probe than the probes it saved
    log2q = (q.to(tl.int32, bitcast=True) - 0x3F800000).to(tl.float32) * (1.0 / 8388608.0)
    return _z_of_tail(tl.sqrt(-1.3862943611198906 * log2q), p)  # t = sqrt(-2 ln q)


@triton.jit
def _z_of_tail(t, p):
    """Abramowitz-Stegun 26.2.23 (|error| < 4.5e-4): the normal z whose tail beyond it holds
    q = min(p, 1 - p), from t = sqrt(-2 ln q); positive for p < 1/2."""
    z = t - tl.fdiv(
        2.515517 + t * (0.802853 + t * 0.010328),
        1.0 + t * (1.432788 + t * (0.189269 + t * 0.001308)),
        ieee_rounding=False,
    )
    return tl.where(p < 0.5, z, -z)


@triton.jit
def _kth_key(key, valid, n_valid, KSEL: tl.constexpr, GUESSES: tl.constexpr):
    """Narrow a bracket [lo, hi) of keys around the row's k-th largest (k = KSEL < n_valid):
    n_lo = count(key >= lo) >= KSEL > n_hi = count(key >= hi), from the row's smallest key
    to one past its largest. Invalid entries hold the smallest int32: every probe is above
    lo, so they are never counted.

    The first GUESSES probes interpolate in the probit of the counts (a normal row's count
    above v is n (1 - Phi((v - mu) / sigma)), so its probit is linear in v: 6.8 counts per
    row of the bench's 128K prefill where counts interpolated linearly took 10.2,
    `benchmarks/indexer_search_counts.py`), with the Illinois rule (the
    stale end moves halfway to the aim); the rest halve the key interval. Any probe strictly
    inside keeps the bracket, so the result does not depend on the guesses: they only decide
    how many counts it takes. Stops at a probe that counts exactly KSEL (`exact`: select
    `key >= lo`), or when the bracket is one key wide (lo is the k-th key, tied: n_lo - n_hi
    keys equal it, n_hi are above it)."""
    lo = tl.min(tl.where(valid, key, 0x7FFFFFFF)).to(tl.int64)
    hi = tl.max(key).to(tl.int64) + 1
    v_lo = _value_of(lo)
    v_hi = _value_of(hi - 1)
    n = n_valid.to(tl.float32)
    n_lo = n_valid
    n_hi = n_valid * 0
    z_aim = _upper_z(KSEL - 0.5, n)
    z_lo = _upper_z(n, n)
    z_hi = _upper_z(0.0, n)
    side = 0
    probes = 0
    exact = 0
    while (exact == 0) & (hi - lo > 1):
        half = lo + (hi - lo) // 2
        guess = v_lo + (v_hi - v_lo) * tl.fdiv(z_aim - z_lo, z_hi - z_lo, ieee_rounding=False)
        probe = _order_key(guess).to(tl.int64)
        probe = tl.where((probes < GUESSES) & (probe > lo) & (probe < hi), probe, half)
        c = _count(key >= probe.to(tl.int32))
        probes += 1
        if c >= KSEL:
            exact = (c == KSEL).to(tl.int32)
            lo = probe
            v_lo = _value_of(probe)
            n_lo = c
            z_lo = _upper_z(c.to(tl.float32), n)
            if side == 1:
                z_hi = z_aim + (z_hi - z_aim) * 0.5
            side = 1
        else:
            hi = probe
            v_hi = _value_of(probe)
            n_hi = c
            z_hi = _upper_z(c.to(tl.float32), n)
            if side == -1:
                z_lo = z_aim + (z_lo - z_aim) * 0.5
            side = -1
    return lo.to(tl.int32), n_lo, n_hi, exact


@triton.jit
def _topk_select(
    S, IDS, BITS, QPOS,
    s_stride_r, ids_stride_r, bits_stride_r,
    row_base,
    HKV: tl.constexpr, KSEL: tl.constexpr, KSELP: tl.constexpr,
    NBP: tl.constexpr, NW: tl.constexpr, NWO: tl.constexpr, BLK: tl.constexpr,
    RANK_MAX: tl.constexpr, GUESSES: tl.constexpr, WRITE_IDS: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """NBP: the blocks this launch's rows can have (a power of two >= their largest past);
    NWO >= NW = NBP / 32: the bitmap words of a row in BITS (the words past NW are 0).
    WRITE_IDS: also the ids (the indexer KL's input); the attention reads only the bitmap,
    and the ids' scattered stores were a tenth of this kernel's instructions."""
    pdl.wait_prior(PDL)
    pdl.release_next(PDL)
    local = tl.program_id(0).to(tl.int64)
    row = row_base * HKV + local
    npast = tl.load(QPOS + row // HKV) // BLK
    # The row held as (NW, 32): entry (w, i) is block 32 w + i, i.e. bit i of bitmap word w,
    # so the words, the per-word counts and the ranks are reductions along one axis.
    bit = tl.arange(0, 32)[None, :]
    b = tl.arange(0, NW)[:, None] * 32 + bit
    valid = b < npast
    # loaded in whole 4-entry vectors (the mask is constant over each; the row is NBP >= 32
    # wide, so they stay inside it): a per-entry mask split every load into four
    x = tl.load(S + local * s_stride_r + b, mask=b < (npast + 3) // 4 * 4, other=0.0)
    # invalid entries take the smallest key: below every probe, so counts need no mask
    key = tl.where(valid, _order_key(x), tl.full(b.shape, -0x7FFFFFFF - 1, tl.int32))
    if npast <= KSEL:
        sel = valid
    elif NBP <= RANK_MAX:
        # small rows: a block's rank is how many valid blocks beat it (ties: lower id wins)
        flat_key = tl.reshape(key, (NBP,))
        flat_valid = tl.reshape(valid, (NBP,))
        ids = tl.arange(0, NBP)
        beats = (flat_key[None, :] > flat_key[:, None]) | (
            (flat_key[None, :] == flat_key[:, None]) & (ids[None, :] < ids[:, None])
        )
        rank = tl.sum((beats & flat_valid[None, :]).to(tl.int32), axis=1)
        sel = tl.reshape(flat_valid & (rank < KSEL), (NW, 32))
    else:
        # long rows: narrow a bracket on the k-th largest key, then take ties by lower id
        tau, n_lo, n_hi, exact = _kth_key(key, valid, tl.minimum(npast, NBP), KSEL, GUESSES)
        if exact == 1:  # exactly KSEL keys >= tau: nothing tied at the boundary
            sel = valid & (key >= tau)
        else:  # tau is the k-th key: n_hi keys above it, n_lo - n_hi equal to it
            need = KSEL - n_hi
            if n_lo - n_hi > need:  # rare (equal scores): rank the ties, lower id first
                tied = valid & (key == tau)
                sel = (valid & (key > tau)) | (tied & (_inclusive_rank(tied) <= need))
            else:
                sel = valid & (key >= tau)
    if WRITE_IDS:
        slot = _inclusive_rank(sel) - 1
        tl.store(IDS + row * ids_stride_r + slot, b, mask=sel)
        n_sel = _count(sel)
        j = tl.arange(0, KSELP)
        tl.store(
            IDS + row * ids_stride_r + j,
            tl.full([KSELP], -1, tl.int32),
            mask=(j >= n_sel) & (j < KSEL),
        )
    packed = tl.sum(sel.to(tl.uint32) << bit.to(tl.uint32), axis=1).to(tl.int32, bitcast=True)
    tl.store(BITS + row * bits_stride_r + tl.arange(0, NW), packed)
    if NWO > NW:
        rest = tl.arange(0, NWO)
        tl.store(BITS + row * bits_stride_r + rest, tl.zeros([NWO], tl.int32), mask=rest >= NW)


@dataclass(frozen=True)
class Selection:
    """The indexer's decision for every query row of a call, per KV group."""

    ids: Tensor | None  # (N, Hkv, KSEL) int32, ascending, -1 padded; None: not asked for
    bits: Tensor  # (N, Hkv, NW) int32 bitmap over blocks
    scores: Tensor | None = None  # not kept: recomputed where a loss needs them


def select_blocks(
    qi: Tensor,
    block_keys: Tensor,
    tiles: QueryTiles,
    bk_table: PagedKV,
    *,
    topk_blocks: int,
    block: int,
    rank_max: int = 128,
    precision: str = "ieee",
    guesses: int = 24,
    ids: bool = True,
) -> Selection:
    """Top-`topk_blocks` complete past blocks per (query row, group).

    qi (N, Hkv, IDX) fp32 index queries; block_keys (R_bk, IDX) fp32 pool addressed by
    `bk_table` (row offset of each logical page's first block; page_size = blocks per page).
    `precision`: "ieee" (exact fp32 products) or "tf32" (tensor cores; what bf16 models use
    on the GPU: both engine and trainer, so the selection is still one function).
    `guesses`: interpolated probes of the k-th-key search before it only halves (0: a plain
    bisection; the selection is the same for any value, only its cost changes). `ids`:
    also the selected ids (the indexer KL's input); without, only the bitmap (what the
    attention reads).
    """
    check_device(qi, block_keys)
    n, hkv, idx = qi.shape
    dev = qi.device
    max_pos = tiles.max_pos
    nbp = next_pow2(max_pos // block, at_least=32)
    nw = nbp // 32
    out = Selection(
        torch.empty(n, hkv, topk_blocks, dtype=torch.int32, device=dev) if ids else None,
        torch.empty(n, hkv, nw, dtype=torch.int32, device=dev),
    )
    if n == 0:
        return out
    rows_per_chunk = max(1, SCORE_CHUNK_BYTES // (hkv * nbp * 4))
    for r0, r1, t0, t1 in _row_chunks(tiles.host_row, tiles.host_rows, rows_per_chunk):
        # Only as wide as this chunk's own queries reach (host positions where the plan has
        # them): the early queries of a long prefill score and rank a fraction of the row.
        top = max(tiles.host_hi[t0:t1]) - 1 if tiles.host_hi else max_pos
        nbp_c = next_pow2(top // block, at_least=32)
        scores = torch.empty((r1 - r0) * hkv, nbp_c, dtype=torch.float32, device=dev)
        sub = _tile_slice(tiles, t0, t1)
        n_bt = triton.cdiv(max(top // block, 1), NBT)
        _index_scores[(t1 - t0, n_bt)](
            qi, block_keys, scores,
            qi.stride(0), qi.stride(1), block_keys.stride(0), scores.stride(0),
            sub.seq, sub.slot0, sub.lo, sub.hi, sub.row,
            bk_table.block_table, bk_table.block_table.stride(0),
            r0,
            HKV=hkv, T=tiles.T, IDX=idx, IDXP=next_pow2(idx), NBT=NBT,
            BPP=bk_table.page_size, BLK=block, UPCAST=interpreting(), PRECISION=precision,
            **pdl.launch(dev),
        )  # fmt: skip
        _rank_rows(scores, out, tiles.q_pos, r0, hkv, topk_blocks, block, rank_max, guesses)
    return out


def _rank_rows(
    scores: Tensor, out: Selection, q_pos: Tensor, row_base: int, hkv: int, topk: int,
    block: int, rank_max: int, guesses: int,
) -> None:  # fmt: skip
    """`_topk_select` over every row of one score buffer (a power of two wide) into `out`."""
    nbp = scores.shape[1]
    ids = out.bits if out.ids is None else out.ids  # not written without ids
    _topk_select[(scores.shape[0],)](
        scores, ids, out.bits, q_pos,
        scores.stride(0), ids.stride(1), out.bits.stride(1),
        row_base,
        HKV=hkv, KSEL=topk, KSELP=next_pow2(topk), NBP=nbp, NW=nbp // 32,
        NWO=out.bits.shape[-1], BLK=block, RANK_MAX=rank_max, GUESSES=guesses,
        WRITE_IDS=out.ids is not None,
        num_warps=max(4, min(32, nbp // (32 * SELECT_PER_THREAD))), **pdl.launch(scores.device),
    )  # fmt: skip


def select_from_scores(
    scores: Tensor,
    n_past: Tensor,
    *,
    topk_blocks: int,
    rank_max: int = 128,
    guesses: int = 24,
) -> Selection:
    """The selection `select_blocks` makes, from given score rows: row r's blocks are
    scores[r, :n_past[r]] (the rest is not read). Runs the same `_topk_select` (with one
    group and blocks of one position), so a test or a probe can hand it any score row:
    ties, signed zeros, values over many binades."""
    check_device(scores)
    r, width = scores.shape
    nbp = next_pow2(width, at_least=32)
    if width != nbp:
        scores = torch.nn.functional.pad(scores, (0, nbp - width))
    scores = scores.float().contiguous()
    out = Selection(
        torch.empty(r, 1, topk_blocks, dtype=torch.int32, device=scores.device),
        torch.empty(r, 1, nbp // 32, dtype=torch.int32, device=scores.device),
    )
    q_pos = n_past.to(torch.int32).contiguous()
    _rank_rows(scores, out, q_pos, 0, 1, topk_blocks, 1, rank_max, guesses)
    return out


def _row_chunks(
    starts: tuple[int, ...], counts: tuple[int, ...], rows_per_chunk: int
) -> list[tuple[int, int, int, int]]:
    """Split the tiles into runs whose query rows [r0, r1) fit one score buffer."""
    chunks, t0 = [], 0
    n_tiles = len(starts)
    ends = [a + b for a, b in zip(starts, counts, strict=True)]
    while t0 < n_tiles:
        t1 = t0 + 1
        while t1 < n_tiles and ends[t1] - starts[t0] <= rows_per_chunk:
            t1 += 1
        chunks.append((starts[t0], ends[t1 - 1], t0, t1))
        t0 = t1
    return chunks


def _tile_slice(tiles: QueryTiles, t0: int, t1: int) -> QueryTiles:
    return QueryTiles(
        tiles.T,
        tiles.seq[t0:t1],
        tiles.slot0[t0:t1],
        tiles.lo[t0:t1],
        tiles.hi[t0:t1],
        tiles.row[t0:t1],
        tiles.q_seq,
        tiles.q_pos,
        tiles.max_pos,
    )


@triton.jit
def _union_steps(
    BITS, OFF, IDS, COUNTS,
    tile_slot0, tile_lo, tile_hi, tile_row,
    sb_stride_n, sb_stride_g, nw_bits, nw_iter,
    COUNT_ONLY: tl.constexpr, T: tl.constexpr, WB: tl.constexpr,
    NBS: tl.constexpr, BLK: tl.constexpr, PREFIX: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """Per (tile, group): the ascending steps holding a block any present row selected, or a
    present row's own block. COUNT_ONLY writes the count at OFF[i + 1] (and OFF[0] = 0);
    otherwise the ids from OFF[i] on, or with PREFIX from the sum of the counts before it
    (COUNTS, the count pass's output), which it also writes to OFF[i] (and the total to
    the last OFF): no separate prefix sum."""
    pdl.wait_prior(PDL)
    pdl.release_next(PDL)
    tile = tl.program_id(0)
    g = tl.program_id(1)
    hkv = tl.num_programs(1)
    slot0 = tl.load(tile_slot0 + tile)
    lo = tl.load(tile_lo + tile)
    hi = tl.load(tile_hi + tile)
    row0 = tl.load(tile_row + tile)
    own_lo, own_hi = lo // BLK, (hi - 1) // BLK
    me = tile * hkv + g
    if COUNT_ONLY:
        base = 0
        if me == 0:
            tl.store(OFF, 0)
    elif PREFIX:
        # integer sum of the counts of the (tile, group)s before this one: exact, any order
        acc = tl.zeros([256], tl.int32)
        c = tl.arange(0, 256)
        for j0 in range(0, me, 256):
            acc += tl.load(COUNTS + 1 + j0 + c, mask=j0 + c < me, other=0)
        base = tl.sum(acc, axis=0)
        tl.store(OFF + me, base)
    else:
        base = tl.load(OFF + me)
    count = 0
    w = tl.arange(0, WB)
    bit = tl.arange(0, 32)
    spw: tl.constexpr = 32 // NBS  # steps per word
    for w0 in range(0, nw_iter, WB):
        words = tl.zeros([WB], tl.int32)
        for s in range(T):
            pos = slot0 + s
            row = (row0 + pos - lo).to(tl.int64)
            present = (pos >= lo) & (pos < hi)
            # compared, not combined by &: Triton 3.9's interpreter types a scalar-bool &
            # vector-bool as int32, which it refuses as a mask
            in_word = (w0 + w < nw_bits) & (tl.zeros([WB], tl.int32) + present.to(tl.int32) == 1)
            words |= tl.load(
                BITS + row * sb_stride_n + g * sb_stride_g + w0 + w,
                mask=in_word,
                other=0,
            )
        blocks = (w0 + w)[:, None] * 32 + bit[None, :]
        on = (((words[:, None] >> bit[None, :]) & 1) == 1) | (
            (blocks >= own_lo) & (blocks <= own_hi)
        )
        steps = tl.max(tl.reshape(on.to(tl.int32), (WB, spw, NBS)), axis=2)
        flat = tl.reshape(steps, (WB * spw,))
        if not COUNT_ONLY:
            slot = base + count + tl.cumsum(flat, axis=0) - 1
            ids = (w0 * 32) // NBS + tl.arange(0, WB * spw)
            tl.store(IDS + slot, ids, mask=flat == 1)
        count += tl.sum(flat, axis=0)
    if COUNT_ONLY:
        tl.store(OFF + me + 1, count)
    elif PREFIX:
        if me == tl.num_programs(0) * hkv - 1:
            tl.store(OFF + me + 1, base + count)


def union_steps(
    sel: Selection, tiles: QueryTiles, *, block: int, step: int, sync_free: int = SYNC_FREE_IDS
) -> tuple[Tensor, Tensor]:
    """CSR (offsets (n_tiles * Hkv + 1,), step ids) of the aligned key steps each
    (tile, group) visits: steps holding a block selected by, or the current block of, any
    present row, ascending. Built from the selection bitmaps by two launches (count, then
    write), so no per-row id lists are gathered or sorted. Id buffers up to `sync_free`
    are sized by a bound (no device sync); larger ones by the total, read back."""
    n, hkv, nw_bits = sel.bits.shape
    dev = sel.bits.device
    nbs = max(step // block, 1)
    assert 32 % nbs == 0
    nw_iter = tiles.max_pos // block // 32 + 1
    wb = min(64, next_pow2(nw_iter, at_least=1))
    if tiles.n_tiles == 0:
        counts = torch.zeros(1, dtype=torch.int32, device=dev)
        return counts, counts[:0]
    counts = torch.empty(tiles.n_tiles * hkv + 1, dtype=torch.int32, device=dev)
    args = (
        tiles.slot0,
        tiles.lo,
        tiles.hi,
        tiles.row,
        sel.bits.stride(0),
        sel.bits.stride(1),
        nw_bits,
        nw_iter,
    )
    meta = {"T": tiles.T, "WB": wb, "NBS": nbs, "BLK": block, **pdl.launch(dev)}
    grid = (tiles.n_tiles, hkv)
    dummy = counts[:1]
    _union_steps[grid](sel.bits, counts, dummy, dummy, *args, COUNT_ONLY=True, PREFIX=False, **meta)
    # an upper bound on the ids avoids reading the total back (a device sync) when small;
    # then the write pass sums the counts before each (tile, group) itself (two launches)
    bound = tiles.n_tiles * hkv * (tiles.max_pos // step + 1)
    if bound <= sync_free and tiles.n_tiles * hkv <= PREFIX_MAX:
        offsets = torch.empty_like(counts)
        ids = torch.empty(bound, dtype=torch.int32, device=dev)
        _union_steps[grid](sel.bits, offsets, ids, counts, *args, COUNT_ONLY=False, PREFIX=True,
                           **meta)  # fmt: skip
        return offsets, ids
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    size = bound if bound <= sync_free else int(offsets[-1])
    ids = torch.empty(size, dtype=torch.int32, device=dev)
    _union_steps[grid](sel.bits, offsets, ids, dummy, *args, COUNT_ONLY=False, PREFIX=False, **meta)
    return offsets, ids
