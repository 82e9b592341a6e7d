"""The grouped products' plan from per-expert row counts, in one launch.

From `counts` (E,) rows per expert (rows sorted by expert), one program writes:
- the tile table of `max_tiles` tiles of BM rows: per tile (expert, first row, rows), the
  experts' tiles in expert order, then surplus tiles of 0 rows (`max_tiles` >=
  cdiv(total, BM) + E bounds the grid without reading the counts on the host);
- `offsets` (E,) int32: cumulative counts (expert e's rows end at offsets[e]), the form
  `torch._grouped_mm` and the backward take;
- `empty` (E,) bool: experts without rows (their weight gradients must be exactly 0).

`zero_empty_experts` then writes those exact zeros into a grouped weight gradient (E, ., .):
only the empty experts' slices are touched, where a `masked_fill_` read and wrote all E.

Invariant: the same integers as the torch form the trainer ran before (a searchsorted over
the tile ends; `tests/kernels/test_expert_plan.py` keeps it as the oracle), surplus tiles
included, so every kernel that reads the table is unchanged. It replaces that form's ~13
small torch ops per MoE layer and micro-batch (each a launch and a dispatch the trainer's
host pays for) with one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from rlsys.kernels.triton_ops import pdl
from rlsys.kernels.triton_ops.common import check_device, next_pow2

TILE_CHUNK = 128  # tiles per step of the program's walk over the table
ZERO_SPLIT = 16  # programs per expert of `zero_empty_experts` (each a contiguous part)
ZERO_BLOCK = 2048  # elements per store of `zero_empty_experts`


@triton.jit
def _expert_plan(
    COUNTS, T_EXPERT, T_ROW0, T_ROWS, OFFSETS, EMPTY, E, max_tiles,
    EP: tl.constexpr, CH: tl.constexpr, BM: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl.wait_prior(PDL)
    pdl.release_next(PDL)
    ids = tl.arange(0, EP)
    on = ids < E
    counts = tl.load(COUNTS + ids, mask=on, other=0).to(tl.int32)
    per = (counts + BM - 1) // BM  # tiles per expert
    tile_end = tl.cumsum(per, axis=0)
    row_end = tl.cumsum(counts, axis=0)
    tl.store(OFFSETS + ids, row_end, mask=on)
    tl.store(EMPTY + ids, counts == 0, mask=on)
    used = tl.sum(per, axis=0)
    c = tl.arange(0, CH)
    for t0 in range(0, max_tiles, CH):
        t = t0 + c
        # the tile's expert: how many experts' tiles end at or before it (a right-sided
        # search), the last expert for surplus tiles
        e = tl.sum(((tile_end[None, :] <= t[:, None]) & on[None, :]).to(tl.int32), axis=1)
        e = tl.minimum(e, E - 1)
        pick = ids[None, :] == e[:, None]
        count_e = tl.sum(tl.where(pick, counts[None, :], 0), axis=1)
        j = t - tl.sum(tl.where(pick, (tile_end - per)[None, :], 0), axis=1)
        rows = tl.minimum(tl.maximum(count_e - j * BM, 0), BM)
        rows = tl.where(t < used, rows, 0)
        row0 = tl.sum(tl.where(pick, (row_end - counts)[None, :], 0), axis=1) + j * BM
        m = t < max_tiles
        tl.store(T_EXPERT + t, e, mask=m)
        tl.store(T_ROW0 + t, row0, mask=m)
        tl.store(T_ROWS + t, rows, mask=m)


def expert_plan(
    counts: Tensor, max_tiles: int, bm: int
) -> tuple[tuple[Tensor, Tensor, Tensor], Tensor, Tensor]:
    """(tile table (expert, first row, rows) int32 x `max_tiles`, offsets (E,) int32,
    empty (E,) bool) of rows sorted by expert, `counts` (E,) rows per expert (any int)."""
    check_device(counts)
    e = counts.shape[0]
    dev = counts.device
    tiles = tuple(torch.empty(max_tiles, dtype=torch.int32, device=dev) for _ in range(3))
    offsets = torch.empty(e, dtype=torch.int32, device=dev)
    empty = torch.empty(e, dtype=torch.bool, device=dev)
    _expert_plan[(1,)](
        counts, *tiles, offsets, empty, e, max_tiles,
        EP=next_pow2(e, 2), CH=TILE_CHUNK, BM=bm, **pdl.launch(dev),
    )  # fmt: skip
    return tiles, offsets, empty  # type: ignore[return-value]


@triton.jit
def _zero_empty(G, EMPTY, per, part, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl.wait_prior(PDL)
    pdl.release_next(PDL)
    e = tl.program_id(0)
    if tl.load(EMPTY + e):  # most experts have rows: their programs load one byte
        start = tl.program_id(1).to(tl.int64) * part
        end = tl.minimum(start + part, per)
        base = G + e.to(tl.int64) * per
        c = tl.arange(0, BLOCK)
        for i in range(start, end, BLOCK):
            tl.store(base + i + c, tl.zeros([BLOCK], G.dtype.element_ty), mask=i + c < end)


def zero_empty_experts(grads: Tensor, empty: Tensor) -> Tensor:
    """`grads` (E, ., .) with exact zeros in the `empty` experts' slices, in place (a grouped
    GEMM over an empty group reduces over nothing and is not relied on to write zeros)."""
    check_device(grads, empty)
    if not grads.is_contiguous():
        return grads.masked_fill_(empty[:, None, None], 0.0)
    e = grads.shape[0]
    per = grads[0].numel() if e else 0
    if per:
        part = triton.cdiv(triton.cdiv(per, ZERO_SPLIT), ZERO_BLOCK) * ZERO_BLOCK
        _zero_empty[(e, triton.cdiv(per, part))](
            grads, empty, per, part, BLOCK=ZERO_BLOCK, **pdl.launch(grads.device)
        )
    return grads
