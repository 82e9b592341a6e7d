"""The Sparse GQA backward's query-tile walks over packed blocks (trainer only).

The forward walks aligned key steps (two 8-key blocks at `large`'s and deep-92's shapes):
its bits must not depend on which other queries share a tile, so a step is a function of
positions alone. Under the indexer's selection most steps of a tile's union hold only one
block any of its queries chose: on the benchmarks' selection (`benchmarks/union_waste.py`)
the steps carry 2.01x the selected keys at 32K, the blocks themselves 1.24x. The backward
only has to be deterministic, so its query-tile walks (dq) take the tile's union of
BLOCKS, ascending, STEP // BLK of them per visit: the same products on 1.6x fewer visits.
So does the indexer KL's block mass (`attention_bwd._block_mass`).

- `union_blocks`: per (tile, group), the ascending blocks a present row selected or holds
  (`indexer.union_steps` at one block per step).
- `packed_visit`: visit `i` of such a list, loaded: which row sees which key, the keys, the
  values and the scores, as `attention_fwd.visible_step` gives them for a step.
Invariant: a visit's keys are distinct, ascending, and each sits in exactly one visit of
its (tile, group), so the visits' sum over keys is every key once: dq is a sum over the
same (row, key) terms as the step walk's, grouped otherwise (equal to fp32 rounding, and
the same bits run to run).
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from rlsys.kernels.attention_plan import QueryTiles
from rlsys.kernels.triton_ops.attention_fwd import key_rows
from rlsys.kernels.triton_ops.common import mma

# ids up to this many (int32: 256 MiB) are allocated by a bound instead of read back: a
# 32K sequence's block lists need 34M (tiles x groups x blocks), over the forward's bound,
# and a device sync would break the trainer's graph capture
SYNC_FREE_BLOCK_IDS = 1 << 26


def union_blocks(bits: Tensor, tiles: QueryTiles, *, block: int) -> tuple[Tensor, Tensor]:
    """CSR (offsets (n_tiles * Hkv + 1,), block ids) of the blocks each (tile, group)'s
    present rows selected or hold, ascending (`bits`: the selection's (N, Hkv, NW) bitmap)."""
    from rlsys.kernels.triton_ops.indexer import Selection, union_steps

    return union_steps(
        Selection(ids=None, bits=bits), tiles, block=block, step=block,
        sync_free=SYNC_FREE_BLOCK_IDS,
    )  # fmt: skip


@triton.jit
def packed_visit(
    i, last, block_ids, q, qk_scale, qpos, present, qrow, lo, hi, g, sel_bits, sb_stride_n,
    sb_stride_g, seq, K, V, k_stride_g, block_table, bt_stride, k_stride_r, d,
    D: tl.constexpr, STEP: tl.constexpr, PAGE: tl.constexpr, BLK: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, CONTIG: tl.constexpr, seq_row0,
    VALUES: tl.constexpr = True,
):  # fmt: skip
    """Visit `i` of a (tile, group)'s block list [.., last): its STEP // BLK blocks from
    slot i on (-1 past `last`: keys never loaded, never seen). Returns
    (vis, picked, k, v, s): vis (M, STEP) which row sees which key (as `visible_step`
    gives it), picked (M, NB) which row selected which of the visit's blocks, K and V
    rows (zeros where not loaded: a padded block, or at or past the tile's end; V is K
    unless VALUES), s = q k^T * qk_scale for q's rows (M of them, or a multiple: the
    block mass's heads over the same slots)."""
    NB: tl.constexpr = STEP // BLK
    tl.static_assert(BLK <= 16)
    PAST: tl.constexpr = 2**27  # a block past every row (x BLK <= 2^31: no overflow)
    j = tl.arange(0, STEP)
    # each of the visit's blocks a scalar (-1: a padded slot past `last`), its keys' block
    # ids, and each row's selection bit for it: one bitmap word per (row, block)
    kb = tl.full([STEP], -1, tl.int32)
    chosen = tl.zeros([qpos.shape[0], STEP], tl.int1)
    picked = tl.zeros([qpos.shape[0], NB], tl.int1)
    top = -1
    for b in tl.static_range(NB):
        blk = tl.load(block_ids + i + b, mask=i + b < last, other=-1)
        mine = (j // BLK) == b
        kb = tl.where(mine, blk, kb)
        top = tl.maximum(top, blk)
        wblk = tl.where(blk >= 0, blk, PAST)  # a padded slot: no row loads its word
        word = tl.load(
            sel_bits + qrow * sb_stride_n + g * sb_stride_g + wblk // 32,
            mask=present & (wblk * BLK <= qpos),
            other=0,
        )
        on = ((word >> (wblk % 32)) & 1) == 1
        chosen = chosen | (on[:, None] & mine[None, :])
        picked = picked | (on[:, None] & (tl.arange(0, NB) == b)[None, :])
    kpos = kb * BLK + j % BLK
    kneed = (kb >= 0) & (kpos < hi)
    if CONTIG:
        krow = (seq_row0 + kpos).to(tl.int64)
    else:
        krow = key_rows(block_table, bt_stride, seq, kpos, kneed, PAGE)
    offs = g * k_stride_g + krow[:, None] * k_stride_r + d[None, :]
    kmask = kneed[:, None] & (d < D)[None, :]
    k = tl.load(K + offs, mask=kmask, other=0.0)
    if VALUES:
        v = tl.load(V + offs, mask=kmask, other=0.0)
    else:
        v = k
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    if (top + 1) * BLK <= lo // BLK * BLK:  # before every present row's own block
        vis = chosen
    else:
        causal = (kpos[None, :] <= qpos[:, None]) & present[:, None] & kneed[None, :]
        own = kb[None, :] == (qpos // BLK)[:, None]
        vis = causal & (own | chosen)
    s = mma(q, tl.trans(k), PRECISION, UPCAST) * qk_scale
    return vis, picked, k, v, s
