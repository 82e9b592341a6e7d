"""A segment's per-token candidate sets, stored as two integer arrays instead of a list each.

`Segment.candidate_ids[i]` is the top-p set token i was sampled from (ids in the engine's
order; [] where the nucleus was capped), or None (not a policy token, or no set recorded).
The engine hands a generation's sets as one Python list per token. Kept so, they are what
packing a step spends most of its host time on once the routes are blocks (one int object
per id to walk: 8K policy tokens with 64-id sets are half a million), and what the stream
pickles one by one. `CandidateRows` turns each appended run into `lengths` (int32, -1 for
None) and the ids laid end to end (`flat`: int16 where every id fits, else int32) once,
where it is appended (the rollout worker, off the trainer's path); packing then gathers
the policy rows with array ops.

Invariants: `len()` is the number of entries appended; entry i reads as it was appended
(a list of ints, [] or None); `arrays()` gives (lengths, flat) of every entry in order,
with `flat` holding exactly `lengths.clip(0).sum()` ids.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

NONE = -1  # the length that reads as None


class CandidateRows(Sequence[Any]):
    """Per-token candidate sets as chunks of (lengths, flat ids), joined on demand."""

    def __init__(self, entries: Iterable[list[int] | None] = ()) -> None:
        self._lengths: list[np.ndarray] = []
        self._flat: list[np.ndarray] = []
        self._len = 0
        self._joined: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self.extend(entries)

    def extend(self, entries: Iterable[list[int] | None]) -> None:
        """Append entries: each a list of ids, or None."""
        items = entries if isinstance(entries, list | tuple) else list(entries)
        if not items:
            return
        lengths = np.fromiter((NONE if e is None else len(e) for e in items), np.int32, len(items))
        total = int(lengths[lengths > 0].sum())
        flat = np.fromiter(itertools.chain.from_iterable(e for e in items if e), np.int64, total)
        # ids of a vocabulary below 2^15 (ours) fit int16: half the bytes on the stream
        flat = flat.astype(np.int16 if total == 0 or flat.max() < 2**15 else np.int32)
        self._lengths.append(lengths)
        self._flat.append(flat)
        self._len += len(items)
        self._joined = None

    def extend_none(self, n: int) -> None:
        """Append n entries without a set (prompt or observation tokens)."""
        if n > 0:
            self._lengths.append(np.full(n, NONE, np.int32))
            self._flat.append(np.zeros(0, np.int16))
            self._len += n
            self._joined = None

    def __iadd__(self, entries: Iterable[list[int] | None]) -> CandidateRows:
        self.extend(entries)
        return self

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(lengths (n,) int32 with -1 for None, flat ids int16 or int32), every entry in
        order."""
        lengths, flat, _ = self._join()
        return lengths, flat

    def _join(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self._joined is None:
            lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int32)
            flat = np.concatenate(self._flat) if self._flat else np.zeros(0, np.int16)
            starts = np.concatenate(([0], np.cumsum(lengths.clip(0))[:-1])).astype(np.int64)
            self._lengths, self._flat = [lengths], [flat]  # one chunk from now on
            self._joined = (lengths, flat, starts)
        return self._joined

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._len))]
        if not isinstance(i, int | np.integer):
            raise TypeError(f"CandidateRows takes an int or a slice, got {type(i).__name__}")
        if not -self._len <= i < self._len:
            raise IndexError(i)
        lengths, flat, starts = self._join()
        n = int(lengths[i])
        return None if n == NONE else flat[starts[i] : starts[i] + n].tolist()

    def __iter__(self) -> Iterator[Any]:
        return (self[j] for j in range(self._len))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CandidateRows | list | tuple):
            return NotImplemented
        return len(self) == len(other) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"CandidateRows(len={self._len}, ids={sum(f.size for f in self._flat)})"

    def __getstate__(self) -> dict[str, Any]:
        lengths, flat = self.arrays()  # one pair of arrays on the stream, no cache
        return {"lengths": lengths, "flat": flat}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._lengths, self._flat = [state["lengths"]], [state["flat"]]
        self._len, self._joined = len(state["lengths"]), None


def candidate_arrays(entries: Sequence[Any], rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The sets of entries `rows` (ascending) as (lengths with 0 for None, their ids end to
    end): gathered with array ops from a `CandidateRows`, converted from a plain list (a
    segment pickled before segments kept `CandidateRows`)."""
    if not isinstance(entries, CandidateRows):
        entries = CandidateRows([entries[i] for i in rows.tolist()])
        rows = np.arange(len(entries))
    lengths, flat, starts = entries._join()
    picked = lengths[rows].clip(0).astype(np.int64)
    total = int(picked.sum())
    if total == 0:
        return picked, np.zeros(0, np.int64)
    # each picked set's ids: its start in `flat`, then consecutive
    first = np.repeat(starts[rows] - np.concatenate(([0], np.cumsum(picked)[:-1])), picked)
    return picked, flat[first + np.arange(total)].astype(np.int64)
