"""The trainer's side of the rollout stream: consume, hold until committed, then acknowledge.

Workers publish scored trajectories to the stream themselves; the controller tells the
trainer which rollout ids make a step. This inbox reads the stream through the trainer's
consumer (one member of the group) until it holds every id asked for, and keeps each
entry until the caller says its step is committed (`commit`), only then acknowledging it.

Invariants:
- an entry is acknowledged only by `commit` (its rollouts are `trained`/filtered in the
  ledger) or `discard` (its rollout ended without training, e.g. its worker died between
  publishing and recording `scored`); nothing else acks, so a crash anywhere before the
  commit leaves the entry pending, and `resume` delivers it again;
- a rollout id published twice (a producer's retry) is held once; every copy is acked with
  it;
- after `resume(committed)`, the entries the checkpoint says were consumed are acked, and
  every other pending entry is back in the inbox: none skipped, none trained twice.
Pure Python over a `RolloutStream`: unit-testable without Ray.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Sequence
from typing import Any

from rlsys.ledger.stream import (
    RolloutStream,
    StreamConnectionError,
    StreamEntry,
    resume_consumer,
)

CONSUMER = "trainer"
READ_BATCH = 256


class MissingTrajectories(RuntimeError):
    """Rollouts asked for never arrived in the stream within the timeout."""


class TrajectoryInbox:
    def __init__(self, stream: RolloutStream, consumer: str = CONSUMER) -> None:
        self.stream, self.consumer = stream, consumer
        self.held: dict[str, Any] = {}  # rollout id -> trajectory
        self.entries: dict[str, list[str]] = {}  # rollout id -> its entry ids (pending on us)
        self.dead: set[str] = set()  # rollouts ended without training: ack on sight
        self.reply_lost = False  # a read failed on the connection: entries may be pending on us

    def resume(self, committed_entries: Sequence[str]) -> int:
        """Ack what the checkpoint consumed; take back every other pending entry."""
        redelivered = resume_consumer(self.stream, self.consumer, committed_entries)
        self._hold(redelivered)
        return len(redelivered)

    def take(self, rollout_ids: Sequence[str], timeout_s: float) -> list[Any]:
        """The trajectories of `rollout_ids`, in that order, reading the stream as needed.

        They stay held (and pending) until `commit`: a failed step can be taken again."""
        deadline = time.monotonic() + timeout_s
        if self.reply_lost:
            # A read the stream carried out while its reply died with the connection left
            # entries pending on us that `read` never returns again: take them back first.
            self._hold(resume_consumer(self.stream, self.consumer, []))
            self.reply_lost = False
        missing = [r for r in rollout_ids if r not in self.held]
        while missing:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                raise MissingTrajectories(
                    f"{len(missing)} of {len(rollout_ids)} rollouts never reached the stream "
                    f"{self.stream.name!r} within {timeout_s:.0f} s (first: {missing[0]})"
                )
            # Short blocking reads: the Redis backend refuses a block longer than its socket
            # timeout, and the loop re-checks the deadline.
            try:
                delivered = self.stream.read(self.consumer, READ_BATCH, block_ms=min(left_ms, 1000))
            except StreamConnectionError:
                self.reply_lost = True
                raise
            self._hold(delivered)
            missing = [r for r in missing if r not in self.held]
        return [self.held[r] for r in rollout_ids]

    def entry_ids(self, rollout_ids: Sequence[str]) -> list[str]:
        return [e for r in rollout_ids for e in self.entries.get(r, [])]

    def commit(self, rollout_ids: Sequence[str]) -> int:
        """The step that consumed `rollout_ids` is committed in the ledger: ack their entries."""
        acked = self.stream.ack(self.entry_ids(rollout_ids))
        for r in rollout_ids:
            self.held.pop(r, None)
            self.entries.pop(r, None)
        return acked

    def discard(self, rollout_ids: Sequence[str]) -> int:
        """These rollouts ended without training: ack their entries now or when they arrive."""
        self.dead.update(rollout_ids)
        return self.commit([r for r in rollout_ids if r in self.entries])

    def _hold(self, delivered: Sequence[StreamEntry]) -> None:
        late_dead = []
        for e in delivered:
            known = self.entries.setdefault(e.rollout_id, [])
            if e.entry_id in known:
                continue  # delivered again (taken back after a lost reply): held already
            known.append(e.entry_id)
            if e.rollout_id in self.dead:
                late_dead.append(e.rollout_id)
            elif e.rollout_id not in self.held:
                self.held[e.rollout_id] = pickle.loads(e.payload)
        if late_dead:
            self.commit(late_dead)

    @property
    def size(self) -> int:
        return len(self.held)
