"""A segment's per-token routed-expert records, kept in the form the engine hands them over.

`Segment.routed_experts[i]` is token i's route (the experts of forward row i - 1), or None.
The engine gives a generation's routes as one compact block (`TokenRoutes`: {"indices":
(L, n, k), "gates": (L, n, k)[, "blocks": (S, n, Hkv, W)]}). Cut into n per-token dicts,
that is n x 2-3 small tensors to build, to pickle through the rollout stream and to stack
again when the trainer packs the segment: about half of packing a step (two 8K-token
sequences of `large`: ~0.1 s of host time while the GPU waits). `RouteRows` keeps each
such block whole, and any other entries (per-token dicts, None) in lists; it reads as the
per-token sequence, and `runs()` gives the trainer the blocks to copy in one go.

Invariants: `len()` is the number of entries appended; entry i reads the same whichever form
stores it (a block's entry j is `{key: block[key][:, j]}`, as `TokenRoutes[j]` cuts it);
the runs are in token order and cover [0, len()) without overlap. A block is kept as given,
not copied: the engine hands each result a block of its own.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

Block = dict[str, Any]  # {"indices": (L, n, k), ...}: n tokens' routes, one tensor per kind


def routes_block(entries: Any) -> Block | None:
    """The block behind `entries` when they are a block-backed sequence (the engine's
    `TokenRoutes`: a `block` dict of (L, n, ...) tensors), else None."""
    block = getattr(entries, "block", None)
    return block if isinstance(block, dict) and "indices" in block else None


class RouteRows(Sequence[Any]):
    """Per-token route entries stored as runs: lists of entries, or whole blocks."""

    def __init__(self, entries: Iterable[Any] = ()) -> None:
        self._starts: list[int] = []  # first token index of each run
        self._runs: list[list[Any] | Block] = []
        self._len = 0
        self.extend(entries)

    def extend(self, entries: Iterable[Any]) -> None:
        """Append entries: a block-backed sequence as one run, anything else entry by entry
        (merged into the last run when that is a list)."""
        block = routes_block(entries)
        if block is not None:
            n = int(block["indices"].shape[1])
            if n:
                self._starts.append(self._len)
                self._runs.append(block)
                self._len += n
            return
        items = list(entries)
        if not items:
            return
        if self._runs and isinstance(self._runs[-1], list):
            self._runs[-1].extend(items)
        else:
            self._starts.append(self._len)
            self._runs.append(items)
        self._len += len(items)

    def __iadd__(self, entries: Iterable[Any]) -> RouteRows:
        self.extend(entries)
        return self

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._len))]
        if not isinstance(i, int):
            raise TypeError(f"RouteRows takes an int or a slice, got {type(i).__name__}")
        if not -self._len <= i < self._len:
            raise IndexError(i)
        i %= self._len
        at = bisect.bisect_right(self._starts, i) - 1
        run, j = self._runs[at], i - self._starts[at]
        if isinstance(run, list):
            return run[j]
        return {key: t[:, j].clone() for key, t in run.items()}

    def __iter__(self) -> Iterator[Any]:
        for start, run in zip(self._starts, self._runs, strict=True):
            if isinstance(run, list):
                yield from run
            else:
                yield from (self[start + j] for j in range(int(run["indices"].shape[1])))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RouteRows | list | tuple):
            return NotImplemented
        return len(self) == len(other) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        kinds = ", ".join(f"{type(run).__name__}@{start}" for start, run in self.runs())
        return f"RouteRows(len={self._len}, runs=[{kinds}])"

    def runs(self) -> list[tuple[int, list[Any] | Block]]:
        """(first token index, a list of entries or a block) in token order."""
        return list(zip(self._starts, self._runs, strict=True))

    def last_recorded(self) -> int:
        """The index of the last entry that is not None (-1 if there is none)."""
        for start, run in zip(reversed(self._starts), reversed(self._runs), strict=True):
            if not isinstance(run, list):
                return start + int(run["indices"].shape[1]) - 1
            for j in range(len(run) - 1, -1, -1):
                if run[j] is not None:
                    return start + j
        return -1


def route_runs(entries: Sequence[Any]) -> list[tuple[int, list[Any] | Block]]:
    """`entries`' runs: a `RouteRows`'s own, or one list run for a plain list (a segment
    pickled before segments kept `RouteRows`)."""
    if isinstance(entries, RouteRows):
        return entries.runs()
    return [(0, list(entries))] if len(entries) else []
