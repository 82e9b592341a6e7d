"""How many passes over its past blocks the streamed indexer selection takes per query tile.

Usage: python benchmarks/indexer_stream_passes.py [--lengths 32768,131072] [--tiles 8]
    [--random-selection] [--topk 4096]

The streamed selection (`rlsys.kernels.triton_ops.indexer_stream`) recomputes a tile's
block scores in each pass: one for the moments, the probe passes, one collecting the last
brackets (taken when any row of the tile needs it), one for the bitmap. Its cost is at most
(3 + probe passes) score products per tile, against the buffered path's one product plus
an fp32 score buffer written and read back. The probe passes depend on the
scores, not the machine, so they are counted here on any machine (the CPU interpreter
runs a sample of tiles: `--tiles` query tiles of 16 positions spread over each length,
at `bench_attention.py`'s `deep-92` shape and clustered index queries). Deterministic.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_attention import PAGE, B, T, index_inputs  # noqa: E402
from rlsys.kernels.attention_plan import PagedKV, Span, contiguous_table, plan_tiles  # noqa: E402
from rlsys.kernels.triton_ops.indexer import select_blocks  # noqa: E402
from rlsys.kernels.triton_ops.indexer_stream import select_blocks_streamed  # noqa: E402


def sampled_passes(length: int, tiles_n: int, topk: int, random_sel: bool, dev: str) -> list[int]:
    """Probe passes of `tiles_n` query tiles at positions spread over [0, length), checking
    that each tile's selection is the buffered path's."""
    qi, bk = index_inputs(length, dev, random_sel)
    kv = contiguous_table([length], PAGE, dev)
    bkt = PagedKV(kv.block_table // B, PAGE // B)
    starts = [(length - T) * (i + 1) // tiles_n // T * T for i in range(tiles_n)]
    spans = [Span(0, i * T, T, p) for i, p in enumerate(starts)]
    rows = torch.cat([qi[p : p + T] for p in starts])
    tiles = plan_tiles(spans, T, dev)
    passes = torch.zeros(tiles.n_tiles, dtype=torch.int32, device=dev)
    kw = {"topk_blocks": topk // B, "block": B, "precision": "tf32"}
    got = select_blocks_streamed(rows, bk, tiles, bkt, passes=passes, **kw)
    want = select_blocks(rows, bk, tiles, bkt, **kw)
    assert got.ids is not None and want.ids is not None
    if not (torch.equal(got.ids, want.ids) and torch.equal(got.bits, want.bits)):
        raise SystemExit(f"{length} tokens: the streamed selection DIFFERS from the buffered")
    return passes.tolist()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--lengths", default="32768,131072")
    p.add_argument("--tiles", type=int, default=8)
    p.add_argument("--topk", type=int, default=4096)
    p.add_argument("--random-selection", action="store_true")
    args = p.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    queries = "random" if args.random_selection else "clustered"
    print(f"{dev}; k = {args.topk} tokens, B = {B}, query tile {T}; {queries} index queries")
    print(
        "\n| tokens | tiles | probe passes: mean | max | score products per tile, at most (mean) |"
    )
    print("|---:|---:|---:|---:|---:|")
    for length in (int(x) for x in args.lengths.split(",")):
        passes = sampled_passes(length, args.tiles, args.topk, args.random_selection, dev)
        mean = statistics.mean(passes)
        print(f"| {length} | {len(passes)} | {mean:.2f} | {max(passes)} | {mean + 3:.2f} |")


if __name__ == "__main__":
    main()
