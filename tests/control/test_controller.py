"""The control loop (`Controller`) against a fake of its Ray edge and a real SQLite ledger.

Only the edge is faked (`FakeCluster`, a `JobCluster`): workers and the trainer answer at
once, one piece of work per wait; everything the loop decides with (planner,
failure handler, step committer, the ledger and its reconcile) is the real thing. No Ray
is started.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from rlsys.control.cluster import ActorDied, Pending
from rlsys.control.controller import Controller
from rlsys.control.job_lifetime import JobLifetime
from rlsys.control.messages import (
    Assignment,
    JsonValue,
    RolloutReport,
    StepReport,
    StreamPosition,
    TrainerPosition,
)
from rlsys.ledger.queries import stats, trainer_steps
from rlsys.ledger.records import Transition
from rlsys.ledger.store import Ledger
from rlsys.types import RolloutState as S
from tests.control.conftest import job_config

pytestmark = pytest.mark.unit

STEPS = 3


class FakeCluster:
    """Workers score each rollout in the ledger as a real worker does (the first member of
    a group passes, the others fail: every group carries a signal); the trainer steps one
    version ahead per batch. Work finishes in the order it was submitted, or with
    `trainer_first` a step before any rollout (rollouts are then in flight when it ends). `log` keeps every call that reaches an actor, in order, with
    what the ledger held at that moment."""

    def __init__(self, ledger: Ledger, job_id: str, *, trainer_first: bool = False) -> None:
        self.ledger, self.job_id, self.trainer_first = ledger, job_id, trainer_first
        self.log: list[tuple[str, Any]] = []
        self.cancelled: list[Pending] = []
        self.fail_publish_at: int | None = None  # a version whose publication raises
        self.dies: str | None = None  # a worker that dies at its first answer
        self._workers = ["worker-0", "worker-1"]
        self._replicas = ["replica-0"]
        self._ids = itertools.count()
        self._work: dict[Pending, tuple[str, Any]] = {}
        self._passed: set[str] = set()  # groups whose passing member was scored
        self._version = 0
        for worker in self._workers:
            self.start_worker(worker)

    def _submit(self, kind: str, payload: Any) -> Pending:
        ref = next(self._ids)
        self._work[ref] = (kind, payload)
        return ref

    def _states(self, rollout_ids: Sequence[str]) -> set[str | None]:
        return {self.ledger.rollout_state(r) for r in rollout_ids}

    # -- rollout workers
    @property
    def workers(self) -> list[str]:
        return list(self._workers)

    def run_rollout(self, worker: str, assignment: Assignment) -> Pending:
        rid = assignment.rollout_id  # the worker takes it at once, as a real one does
        self.ledger.apply(
            [Transition(rid, S.ADMITTED, updates={"owner": worker}), Transition(rid, S.RUNNING)]
        )
        return self._submit("rollout", (worker, assignment))

    def rollout_result(self, pending: Pending) -> RolloutReport:
        worker, a = self._work.pop(pending)[1]
        if worker == self.dies:
            raise ActorDied(f"{worker} died")
        reward = 0.0 if a.group_id in self._passed else 1.0
        self._passed.add(a.group_id)
        self.ledger.apply([Transition(a.rollout_id, S.SCORED, updates={"reward": reward})])
        return RolloutReport(a.rollout_id, S.SCORED.value, f"e-{a.rollout_id}", reward)

    def kill_worker(self, worker: str) -> None:
        # What the dead worker had started is still `running` under it in the ledger:
        # the kill comes before the reconcile that ends those rollouts.
        mine = [a for w, a in (p for k, p in self._work.values() if k == "rollout") if w == worker]
        self.log.append(("kill", (worker, self._states([a.rollout_id for a in mine]))))
        self._workers.remove(worker)

    def start_worker(self, worker: str) -> None:
        self.ledger.heartbeat(worker, self.job_id, lease_s=60.0)  # as a worker's __init__
        self.log.append(("start", worker))
        if worker not in self._workers:
            self._workers.append(worker)

    def cancel_sessions(self, session_ids: Sequence[str]) -> None:
        self.log.append(("cancel_sessions", list(session_ids)))

    # -- the trainer
    def train_step(self, rollout_ids: Sequence[str], timeout_s: float) -> Pending:
        self.log.append(("step", self._states(rollout_ids)))
        return self._submit("step", list(rollout_ids))

    def step_result(self, pending: Pending) -> StepReport:
        batch = self._work.pop(pending)[1]
        self._version += 1
        return StepReport(True, self._version, {"loss": 0.5}, [], [f"e-{r}" for r in batch])

    def trainer_position(self) -> TrainerPosition:
        return TrainerPosition(0, self._version)

    def trainer_held(self) -> list[str]:
        return []

    def trainer_commit(self, rollout_ids: Sequence[str], discard: Sequence[str]) -> None:
        steps = [s["step"] for s in trainer_steps(self.ledger, None)["steps"]]
        self.log.append(("ack", (self._states(rollout_ids), steps)))

    def checkpoint(self, path: str, position: StreamPosition) -> None:
        self.log.append(("checkpoint", position.step))

    def set_trainer_position(self, step: int, version: int) -> None:
        self._version = version

    def replace_trainer(self) -> TrainerPosition:
        raise AssertionError("no trainer dies in these tests")

    # -- engine replicas
    @property
    def replicas(self) -> list[str]:
        return list(self._replicas)

    def publish_weights(self, version: int) -> list[str]:
        if version == self.fail_publish_at:
            raise RuntimeError(f"weights v{version} lost on the way")
        self.log.append(("publish", version))
        return []

    def drop_replica(self, replica_id: str) -> None:
        self._replicas.remove(replica_id)

    def serving_metrics(self) -> dict[str, JsonValue]:
        return {}

    # -- waiting: the oldest work in flight finishes first (`trainer_first`: a step does)
    def wait(self, pending: Sequence[Pending], timeout_s: float) -> list[Pending]:
        steps = [p for p in pending if self._work[p][0] == "step"] if self.trainer_first else []
        return steps or [min(pending)]

    def cancel(self, pending: Pending) -> None:
        self.cancelled.append(pending)


def _controller(ledger: Ledger, job: str, cluster: FakeCluster, tmp_path: Path) -> Controller:
    cfg = job_config().model_copy(deep=True)
    cfg.trainer.steps = STEPS
    return Controller(cfg, job, ledger, cluster, run_dir=tmp_path, start=cluster.trainer_position())


def _kinds(log: list[tuple[str, Any]], *kinds: str) -> list[tuple[str, Any]]:
    return [entry for entry in log if entry[0] in kinds]


def test_steps_run_in_order_one_at_a_time_each_on_a_buffered_batch(ledger, job, tmp_path):
    cluster = FakeCluster(ledger, job)
    assert _controller(ledger, job, cluster, tmp_path).run() == ("completed", f"{STEPS} steps")
    # One step in flight at a time (a second batch is ready while the first trains): each
    # is acked and its weights published before the next is asked for; versions go up by
    # one per step.
    order = [kind for kind, _ in _kinds(cluster.log, "step", "ack", "publish")]
    assert order == ["step", "ack", "publish"] * STEPS
    assert [v for _, v in _kinds(cluster.log, "publish")] == list(range(1, STEPS + 1))
    # The batch is `buffered` in the ledger before the trainer is asked to step on it.
    assert all(states == {"buffered"} for _, states in _kinds(cluster.log, "step"))
    recorded = trainer_steps(ledger, job)["steps"]
    assert [(s["step"], s["policy_version"]) for s in recorded] == [(1, 1), (2, 2), (3, 3)]
    assert [step for _, step in _kinds(cluster.log, "checkpoint")] == [STEPS]  # the last


def test_a_step_is_committed_in_the_ledger_before_its_entries_are_acked(ledger, job, tmp_path):
    cluster = FakeCluster(ledger, job)
    _controller(ledger, job, cluster, tmp_path).run()
    acks = [payload for _, payload in _kinds(cluster.log, "ack")]
    assert len(acks) == STEPS
    for n, (states, steps_recorded) in enumerate(acks, start=1):
        assert states == {"trained"}  # the ledger ended the batch before the stream ack
        assert steps_recorded[-1] == n  # and holds the step's row


def test_a_raise_inside_the_loop_ends_the_job_failed_with_every_rollout_terminal(
    ledger, job, tmp_path
):
    cluster = FakeCluster(ledger, job, trainer_first=True)
    cluster.fail_publish_at = 2  # a crash (not a named end) after the second step
    controller = _controller(ledger, job, cluster, tmp_path)
    with pytest.raises(RuntimeError, match="weights v2 lost"):  # as `run_job` runs the loop
        with JobLifetime(ledger, job, driver_timeout_s=60.0) as life:
            life.phase("loop")
            life.end(*controller.run())
    assert life.status == "failed"
    row = ledger.get_job(job)
    assert row["status"] == "failed"
    assert row["end_reason"] == "RuntimeError: weights v2 lost on the way (during loop)"
    # The work in flight was cancelled, and the ledger names an end for every rollout.
    assert cluster.cancelled and set(cluster.cancelled) == set(controller.running)
    accounting = stats(ledger, job)
    assert accounting["expected"] > 0
    assert accounting["in_flight"] == 0 and accounting["lost"] == 0
    assert sum(accounting["terminal"].values()) == accounting["expected"]


def test_a_dead_worker_is_killed_before_its_rollouts_are_retried_and_replaced(
    ledger, job, tmp_path
):
    cluster = FakeCluster(ledger, job)
    cluster.dies = "worker-0"
    controller = _controller(ledger, job, cluster, tmp_path)
    assert controller.run() == ("completed", f"{STEPS} steps")
    kills = [payload for _, payload in _kinds(cluster.log, "kill")]
    assert len(kills) == 1 and kills[0][0] == "worker-0"
    assert kills[0][1] == {"running"}  # killed before the reconcile ended its rollouts
    assert [w for _, w in _kinds(cluster.log, "start")][-1] in cluster.workers
    assert "worker-0" not in cluster.workers and len(cluster.workers) == 2
    assert controller.stats.worker_deaths == 1
    accounting = stats(ledger, job)
    assert accounting["terminal"]["failed_worker_lost"] > 0 and accounting["retries"] > 0
