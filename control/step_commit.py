"""Committing a trainer step to the ledger, and agreeing with a restored checkpoint.

The order of one step, and why (the stream's entries are acked by the trainer only after
`commit` here returns):
1. `buffer`: the batch's rollouts move `scored -> buffered` before the trainer is asked;
2. the trainer steps and checkpoints, recording the batch and the step's metrics
   (`checkpoint_position`);
3. the step's row is recorded (idempotent), then `commit`: each rollout ends `trained` (or
   the filtered state the trainer named) in one ledger write; only then are the stream
   entries acked.
A crash between 2 and 3 leaves a checkpoint ahead of the ledger: `recover` records the
step and ends the rollouts that checkpoint consumed, so they are neither trained again
nor left live, and the ledger's steps stay contiguous.
A crash before 2 leaves them `buffered` with their entries pending: the step is redone.
No Ray here.
"""

from __future__ import annotations

from collections.abc import Sequence

from rlsys.control.messages import Filtered, StepReport, StreamPosition, TrainerPosition
from rlsys.ledger.records import Transition
from rlsys.ledger.store import Ledger
from rlsys.types import RolloutState as S


class StepCommitter:
    def __init__(self, ledger: Ledger, job_id: str) -> None:
        self.ledger, self.job_id = ledger, job_id
        self.buffered: set[str] = set()  # rollouts already `buffered` (a redone step, a resume)

    def buffer(self, rollout_ids: Sequence[str]) -> None:
        fresh = [r for r in rollout_ids if r not in self.buffered]
        self.ledger.apply([Transition(r, S.BUFFERED) for r in fresh])
        self.buffered.update(fresh)

    def checkpoint_position(
        self, step: int, version: int, rollout_ids: Sequence[str], report: StepReport
    ) -> StreamPosition:
        """What the trainer's checkpoint records about the stream (see `recover`)."""
        return StreamPosition(
            step=step,
            version=version,
            job_id=self.job_id,
            consumed_rollouts=list(rollout_ids),
            consumed_entries=list(report.entries),
            filtered=list(report.filtered),
            stepped=report.stepped,
            metrics=dict(report.metrics),
        )

    def commit(self, rollout_ids: Sequence[str], filtered: Sequence[Filtered], version: int) -> int:
        """End the batch: `trained` at `version`, or the named filtered state. Returns how
        many were filtered stale."""
        by_id = {f.rollout_id: f for f in filtered}
        ends = [
            Transition(r, S(by_id[r].state), reason=by_id[r].reason)
            if r in by_id
            else Transition(r, S.TRAINED, updates={"trained_version": version})
            for r in rollout_ids
        ]
        self.ledger.apply(ends)
        self.buffered.difference_update(rollout_ids)
        return sum(f.state == S.FILTERED_STALE.value for f in filtered)

    def recover(self, position: TrainerPosition) -> list[str]:
        """End what a restored checkpoint consumed but the ledger never recorded; returns
        those rollout ids."""
        stored = position.checkpoint
        if stored is None:
            return []
        live = {S.SCORED.value, S.BUFFERED.value}
        todo = [r for r in stored.consumed_rollouts if self.ledger.rollout_state(r) in live]
        if todo:
            if stored.stepped:
                metrics = {**stored.metrics, "recovered_from_checkpoint": True}
                self.ledger.record_trainer_step(self.job_id, stored.step, stored.version, metrics)
            for r in todo:
                if self.ledger.rollout_state(r) == S.SCORED.value:
                    self.buffer([r])
            self.commit(todo, stored.filtered, stored.version)
        return todo
