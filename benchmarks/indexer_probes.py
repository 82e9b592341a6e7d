"""Counts per row of the indexer's k-th-key search: one row per program vs rows in turn.

Usage: python benchmarks/indexer_probes.py [--contexts 32768,131072] [--queries 32]

The selection kernel (`indexer._topk_select`) runs under Triton's interpreter on the CPU
(`TRITON_INTERPRET=1` is set for you), on score rows shaped like `bench_attention.py`'s
prefill: index queries correlated over 64-token spans (adjacent queries share most of
their top-k), random block keys, B = 8, k = 4,096 (512 blocks). For each context, three
runs of `--queries` consecutive queries (at a quarter, half and the end of the context)
are selected twice: one program per row (each search starts from the row's extremes), and
`indexer.ROWS_MAX` rows per program in turn (each search's first probe is the row before's
k-th key). The table gives the counts over the row (the search's probes, each a pass over
the row and a reduction across the program) per row, and checks that the two selections
are the same. Counts are deterministic: they do not swing with the machine; the GPU time
they save is not measured here.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlsys.kernels.triton_ops import indexer  # noqa: E402

IDX, B, KSEL = 64, 8, 512


class ProbeCounter:
    """Counts `_count` calls made by `_kth_key` (one per probe) while installed."""

    def __init__(self) -> None:
        self.n = 0
        self._orig = indexer._count

    def __enter__(self) -> ProbeCounter:
        orig = self._orig

        def counting(m):  # noqa: ANN001, ANN202
            if sys._getframe(1).f_code.co_name == "_kth_key":  # noqa: SLF001
                self.n += 1
            return orig(m)

        indexer._count = counting  # the interpreter resolves the name at each call
        return self

    def __exit__(self, *exc: object) -> None:
        indexer._count = self._orig


def score_rows(length: int, starts: list[int], queries: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Score rows (one per query, 0-padded to the widest) and each row's past blocks."""
    g = torch.Generator().manual_seed(2)
    centre = torch.randn(length // 64 + 1, IDX, generator=g).repeat_interleave(64, 0)
    keys = torch.randn(length // B, IDX, generator=g)
    rows = [t for s in starts for t in range(s, s + queries)]
    qi = 0.9 * centre[rows] + 0.1 * torch.randn(len(rows), IDX, generator=g)
    scores = qi @ keys.T
    n_past = torch.tensor([t // B for t in rows])
    cols = torch.arange(scores.shape[1])[None, :]
    return torch.where(cols < n_past[:, None], scores, 0.0), n_past


def counts_per_row(scores: torch.Tensor, n_past: torch.Tensor, rows_from: int) -> tuple:
    indexer.ROWS_FROM = rows_from
    with ProbeCounter() as probes:
        sel = indexer.select_from_scores(scores, n_past, topk_blocks=KSEL, rank_max=0)
    return probes.n / scores.shape[0], sel.ids


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--contexts", default="32768,131072")
    parser.add_argument("--queries", type=int, default=32)
    args = parser.parse_args()
    default = indexer.ROWS_FROM
    print(f"| context | rows | counts per row, one per program | {indexer.ROWS_MAX} rows in turn "
          "| change | same selection |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---|")
    for length in (int(c) for c in args.contexts.split(",")):
        starts = [length // 4, length // 2, length - args.queries]
        scores, n_past = score_rows(length, starts, args.queries)
        alone, ids_alone = counts_per_row(scores, n_past, 1 << 62)
        in_turn, ids_turn = counts_per_row(scores, n_past, 1)
        same = torch.equal(ids_alone, ids_turn)
        print(f"| {length} | {scores.shape[0]} | {alone:.2f} | {in_turn:.2f} "
              f"| {in_turn / alone - 1:+.0%} | {same} |", flush=True)  # fmt: skip
    indexer.ROWS_FROM = default


if __name__ == "__main__":
    main()
