"""The Sparse GQA backward's packed walks (`attention_pairs`): each (tile, group)'s union of
BLOCKS, ascending, against a brute force over the rows' bitmaps, and on a GPU, lists past
the forward's id bound built without a device sync (the trainer captures its backward).
The packed dq and block mass themselves are held to the dense oracle with the step walks
in `test_triton_attention.py` (`sparse` and `sparse-steps`)."""

from __future__ import annotations

import pytest
import torch

from rlsys.kernels.attention_plan import Span, plan_tiles
from rlsys.kernels.triton_ops.attention_pairs import union_blocks

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"  # the kernels run where their tensors are (CPU: interpreter)
BLK, T = 8, 4


def _bits(lengths: list[int], hkv: int, seed: int, device: str) -> tuple[torch.Tensor, list]:
    """A selection bitmap like the indexer's: per (row, group), complete past blocks only."""
    g = torch.Generator().manual_seed(seed)
    spans, row = [], 0
    for s, n in enumerate(lengths):
        spans.append(Span(s, row, n, 0))
        row += n
    nw = max(lengths) // BLK // 32 + 1
    bits = torch.zeros(row, hkv, nw, dtype=torch.int64)
    for span in spans:
        for p in range(span.n):
            past = p // BLK  # complete blocks before position p
            pick = torch.rand(hkv, max(past, 1), generator=g) < 0.3
            for b in range(past):
                for grp in range(hkv):
                    if pick[grp, b]:
                        bits[span.row + p, grp, b // 32] |= 1 << (b % 32)
    bits = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)
    return bits.to(device), spans


def _brute_union(bits: torch.Tensor, tiles, hkv: int) -> list[list[int]]:  # noqa: ANN001
    out = []
    for t in range(tiles.n_tiles):
        lo, hi, row = int(tiles.lo[t]), int(tiles.hi[t]), int(tiles.row[t])
        for grp in range(hkv):
            blocks = set(range(lo // BLK, (hi - 1) // BLK + 1))  # the tile's own blocks
            for r in range(row, row + hi - lo):
                for w, word in enumerate(bits[r, grp].tolist()):
                    blocks |= {w * 32 + i for i in range(32) if (word >> i) & 1}
            out.append(sorted(blocks))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_union_blocks_are_each_tiles_selected_and_own_blocks_ascending(seed: int) -> None:
    lengths = [[70], [37, 90], [5, 130, 64], [300]][seed]
    hkv = 1 + seed % 3
    bits, spans = _bits(lengths, hkv, seed, DEV)
    tiles = plan_tiles(spans, T, DEV)
    off, ids = union_blocks(bits, tiles, block=BLK)
    want = _brute_union(bits.cpu(), tiles, hkv)
    got = [ids[int(off[i]) : int(off[i + 1])].tolist() for i in range(tiles.n_tiles * hkv)]
    assert got == want
    # what the packing saves: a pair of blocks a visit, against the aligned 16-key steps
    visits = sum((len(b) + 1) // 2 for b in want)
    steps = sum(len({x // 2 for x in b}) for b in want)
    assert visits < steps


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_union_blocks_past_the_forwards_id_bound_need_no_device_sync() -> None:
    """A 32K sequence's block lists (16-slot tiles) need more ids than the forward's
    sync-free bound: `union_blocks` sizes them by its own, so no total is read back."""
    from rlsys.kernels.triton_ops.indexer import SYNC_FREE_IDS, Selection, union_steps

    length, hkv = 32768, 4
    g = torch.Generator().manual_seed(0)
    words = length // BLK // 32 + 1
    bits = torch.randint(-(2**31), 2**31 - 1, (length, hkv, words), generator=g).to(torch.int32)
    bits = bits.cuda()
    tiles = plan_tiles([Span(0, 0, length, 0)], 16, "cuda")
    assert tiles.n_tiles * hkv * (tiles.max_pos // BLK + 1) > SYNC_FREE_IDS
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        off, ids = union_blocks(bits, tiles, block=BLK)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want_off, want_ids = union_steps(
        Selection(ids=None, bits=bits), tiles, block=BLK, step=BLK, sync_free=0
    )
    assert torch.equal(off, want_off)
    assert torch.equal(ids[: int(off[-1])], want_ids[: int(off[-1])])
