"""Whole-row counts per row of the indexer's k-th-key search (the selection kernel's probes).

Usage: python benchmarks/indexer_search_counts.py [--contexts 32768,131072] [--queries 32]

The selection kernel (`indexer._topk_select`) runs under Triton's interpreter on the CPU
(`TRITON_INTERPRET=1` is set for you) on score rows shaped like `bench_attention.py`'s
prefill: index queries correlated over 64-token spans, random block keys, B = 8, k = 4,096
(512 blocks), `--queries` consecutive queries at a quarter, half and the end of each
context. Each probe of the search is a pass over the row held in registers and a reduction
across the program, counted at `_kth_key`'s calls of `_count`. The table gives the counts
per row with the tree's guesses and with halving alone (`guesses=0`), and checks that both
select the same blocks. Counts are deterministic (they do not swing with the machine); run
the script from an older tree (`git archive`) for that tree's guess rule. The GPU time the
counts cost is `bench_indexer.py`'s.
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
    """Counts the `_count` calls `_kth_key` makes (one per probe) while installed."""

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


def counts_per_row(
    scores: torch.Tensor, n_past: torch.Tensor, guesses: int
) -> tuple[float, torch.Tensor]:
    with ProbeCounter() as probes:
        sel = indexer.select_from_scores(
            scores, n_past, topk_blocks=KSEL, rank_max=0, guesses=guesses
        )
    return probes.n / scores.shape[0], sel.bits


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--contexts", default="32768,131072")
    parser.add_argument("--queries", type=int, default=32)
    args = parser.parse_args()
    print("| context | rows | counts per row, guessed | halving alone | same selection |")
    print("|---:|---:|---:|---:|---|")
    for length in (int(c) for c in args.contexts.split(",")):
        starts = [length // 4, length // 2, length - args.queries]
        scores, n_past = score_rows(length, starts, args.queries)
        guessed, bits_guessed = counts_per_row(scores, n_past, 24)
        halving, bits_halving = counts_per_row(scores, n_past, 0)
        same = torch.equal(bits_guessed, bits_halving)
        print(f"| {length} | {scores.shape[0]} | {guessed:.2f} | {halving:.2f} | {same} |",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
