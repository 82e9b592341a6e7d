"""Decode steps' routes kept as whole-batch blocks until the sequences' logs take them.

A decode step's routes arrive as one compact block for the whole batch, {"indices":
(L, n, k), "gates": (L, n, k)}, and every sequence of the step owns one column of it.
Cutting each sequence's column into its `RouteLog` at every step cost a view per sequence
and key and a log append per sequence: at a batch of 256 that per-sequence work was the
largest single part of the host's share of a graph decode step, and on the GPU the host's
share is what the GPU waits on once it is longer than the step.

The journal keeps an *epoch*: consecutive steps whose rows belong to the same sequences in
the same columns. Within an epoch a step costs one list append; every `FOLD` steps the
epoch's blocks are stacked into one part (L, n, FOLD, k) (one op per key). When the epoch
ends (the batch changes, or something reads or writes a sequence's routes: `close`),
each sequence takes its column of each part, (L, m, k) rows in order, with one log append
per part.

Invariants:
- A sequence's journal rows come after every row already in its log and before any row
  appended to the log after the journal closes: whoever appends to or reads a log that may
  have journal rows closes the journal first (the engine closes it when it settles its
  deferred records, and before a host-scheduled step's routes).
- Rows are handed over exactly once, in step order; a closed journal holds nothing.
- Only blocks without Sparse GQA selections ("blocks", whose width differs per step) are
  journaled; a step with selections is appended row by row (`take` returns False).
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from typing import Protocol

import torch
from torch import Tensor

from rlsys.engine.route_log import RouteLog


class HasRouteLog(Protocol):
    routes: RouteLog


class RouteJournal:
    """The open epoch's blocks and sequences (see module doc)."""

    FOLD = RouteLog.FOLD

    def __init__(self) -> None:
        self._owners: list[tuple[int, HasRouteLog]] = []  # (column, sequence) of the epoch
        self._key: list[tuple[int, int]] = []  # (column, id(sequence)): the epoch's identity
        self._blocks: list[dict[str, Tensor]] = []  # steps not stacked yet
        self._parts: list[dict[str, Tensor]] = []  # stacked steps: (L, n, m, k) per key
        self.steps = 0  # steps held by the open epoch

    def take(
        self, compact: dict[str, Tensor], owners: SequenceABC[tuple[int, HasRouteLog]]
    ) -> bool:
        """Hold one decode step's compact routes; `owners` lists (column, sequence) for
        every row the step's sequences keep. False (nothing held) for a block the journal
        does not take (selections); the caller appends its rows itself."""
        if "blocks" in compact:
            self.close()
            return False
        key = [(i, id(seq)) for i, seq in owners]
        if key != self._key:
            self.close()
            self._owners, self._key = list(owners), key
        self._blocks.append(compact)
        self.steps += 1
        if len(self._blocks) == self.FOLD:
            self._stack()
        return True

    def close(self) -> None:
        """Hand every held row to its sequence's log and end the epoch."""
        if self._blocks:
            self._stack()
        parts, owners = self._parts, self._owners
        self._owners, self._key, self._parts, self.steps = [], [], [], 0
        for part in parts:
            columns = {key: t.unbind(1) for key, t in part.items()}  # one call per key
            for i, seq in owners:
                seq.routes.append_compact({key: cols[i] for key, cols in columns.items()})

    def _stack(self) -> None:
        blocks, self._blocks = self._blocks, []
        self._parts.append({key: torch.stack([b[key] for b in blocks], dim=2) for key in blocks[0]})
