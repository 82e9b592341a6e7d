"""Failure handling: what a failed rollout, a task error and a dead worker do to the job.

Three cases, told apart by the controller's Ray edge:
- a rollout ended in a named failed state (the worker recorded it): it leaves its group;
  a long run of such failures in a row ends the job loudly (a systematic fault);
- a task error (an exception inside `RolloutWorker.run`, the worker still alive): that one
  rollout is ended as `failed_worker_lost` with the error as its reason, and retried;
  the worker keeps its other rollouts and is not replaced;
- the worker's death: its lease is released and reconciled (its admitted/running rollouts
  end `failed_worker_lost`, with linked retries), its never-started assignments go back to
  the queue, and those it scored stay scored (their trajectories are in the stream).
Every retry is planned by the ledger's reconcile in the same transaction that ends the
failed row, and attempts count along the chain (`rollout.max_attempts`). No Ray here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from rlsys.config.job import JobConfig
from rlsys.control.groups import GroupBook
from rlsys.control.messages import Assignment, RolloutReport
from rlsys.ledger.reconcile import ReconcileResult, reconcile_leases, reconcile_rollouts
from rlsys.ledger.records import new_id
from rlsys.ledger.store import Ledger
from rlsys.types import TERMINAL_STATES
from rlsys.types import RolloutState as S

_TERMINAL = {s.value for s in TERMINAL_STATES}


class SystematicFailure(RuntimeError):
    """Every recent rollout failed: the job cannot make progress."""


@dataclass
class Recovery:
    """What the controller does after a failure: assignments to dispatch (retries and
    never-started ones), and rollouts that ended without training (for the trainer's
    inbox to discard any stream entry they left)."""

    dispatch: list[Assignment] = field(default_factory=list)
    ended: list[str] = field(default_factory=list)


class FailureHandler:
    def __init__(self, cfg: JobConfig, job_id: str, ledger: Ledger, book: GroupBook) -> None:
        self.cfg, self.job_id, self.ledger, self.book = cfg, job_id, ledger, book
        self.consecutive = 0
        self.limit = max(32, 4 * cfg.rollout.group_size * cfg.rollout.groups_in_flight)

    def succeeded(self) -> None:
        self.consecutive = 0

    def rollout_failed(self, report: RolloutReport) -> None:
        """The worker ended the rollout in a named failed state."""
        self.book.failed(report.rollout_id)
        self.consecutive += 1
        if self.consecutive >= self.limit:
            reason = self.ledger.rollout_reason(report.rollout_id) or report.state
            raise SystematicFailure(
                f"the last {self.limit} rollouts all failed; the most recent ended "
                f"{report.state}: {reason}"
            )

    def task_error(self, worker: str, a: Assignment, err: BaseException) -> Recovery:
        """An exception inside a live worker's `run`: end (and retry) that rollout only."""
        why = f"task error in {worker}: {type(err).__name__}: {str(err)[:300]}"
        result = reconcile_rollouts(
            self.ledger, self.job_id, [a.rollout_id], S.FAILED_WORKER_LOST, why, **self._retry
        )
        recovery = self._follow(result)
        state = self.ledger.rollout_state(a.rollout_id)
        if a.rollout_id not in result.lost and state == S.SCORED.value:
            self.book.scored(a.rollout_id)  # failed after the ledger recorded it scored
        elif a.rollout_id not in result.lost and state in _TERMINAL:
            self.book.failed(a.rollout_id)
        return recovery

    def worker_died(self, worker: str, assignments: Sequence[Assignment]) -> Recovery:
        """End the dead worker's rollouts as lost (with retries); requeue what it never
        started; keep what it scored."""
        self.ledger.release(worker)
        recovery = self._follow(reconcile_leases(self.ledger, self.job_id, **self._retry))
        handled = set(recovery.ended)
        for a in assignments:
            if a.rollout_id in handled:
                continue
            state = self.ledger.rollout_state(a.rollout_id)
            if state == S.PLANNED.value:
                # A fresh session: the old one's slot on its replica was cancelled.
                recovery.dispatch.append(
                    Assignment(a.rollout_id, a.group_id, a.task_index, new_id("s"))
                )
            elif state == S.SCORED.value:
                self.book.scored(a.rollout_id)  # its trajectory is in the stream
            elif state in _TERMINAL and a.rollout_id in self.book.group_of:
                self.book.failed(a.rollout_id)
        return recovery

    @property
    def _retry(self) -> dict[str, object]:
        return {"retry": self.cfg.rollout.retry_lost, "max_attempts": self.cfg.rollout.max_attempts}

    def _follow(self, result: ReconcileResult) -> Recovery:
        """Mirror a reconcile in the group book; retries of known groups get dispatched."""
        recovery = Recovery(ended=list(result.lost))
        for lost in result.lost:
            if lost not in self.book.group_of:
                continue  # a rollout of a group already trained or dropped
            retry = result.retries.get(lost)
            self.book.failed(lost, retry)
            if retry:
                group = self.book.groups.get(self.book.group_of[retry])
                if group is not None:
                    recovery.dispatch.append(
                        Assignment(retry, group.group_id, group.task_index, new_id("s"))
                    )
        return recovery
