"""Failure handling (`FailureHandler`): task errors apart from deaths, retries through the
ledger's reconcile, attempts counted along the chain. Real SQLite ledger; no Ray."""

import pytest

from rlsys.control.failures import FailureHandler, SystematicFailure
from rlsys.control.messages import RolloutReport
from rlsys.control.planner import Planner
from rlsys.ledger.queries import show
from rlsys.ledger.records import Transition
from rlsys.types import RolloutState as S
from tests.control.conftest import job_config

pytestmark = pytest.mark.unit


def _running(ledger, a, owner="worker-0"):
    ledger.apply(
        [
            Transition(a.rollout_id, S.ADMITTED, updates={"owner": owner}),
            Transition(a.rollout_id, S.RUNNING),
        ]
    )


def _setup(ledger, job, **rollout):
    planner = Planner(job_config(**rollout), job, ledger)
    out = planner.plan(step=0, training=False)
    return planner, FailureHandler(planner.cfg, job, ledger, planner.book), out


def test_a_task_error_ends_that_rollout_only_and_retries_it(ledger, job):
    planner, failures, out = _setup(ledger, job, max_attempts=2)
    for a in out[:2]:
        _running(ledger, a)
    recovery = failures.task_error("worker-0", out[0], ValueError("boom"))
    assert recovery.ended == [out[0].rollout_id]
    assert ledger.rollout_state(out[0].rollout_id) == "failed_worker_lost"
    assert "task error in worker-0: ValueError: boom" in ledger.rollout_reason(out[0].rollout_id)
    assert ledger.rollout_state(out[1].rollout_id) == "running"  # the worker lives on
    [retry] = recovery.dispatch
    assert show(ledger, retry.rollout_id)["rollout"]["retry_of"] == out[0].rollout_id
    assert retry.group_id == out[0].group_id  # the retry replaces it in its group
    assert retry.rollout_id in planner.book.groups[out[0].group_id].members


def test_retries_stop_when_the_chain_uses_up_max_attempts(ledger, job):
    planner, failures, out = _setup(ledger, job, max_attempts=3)
    chain, a = [], out[0]
    while a is not None:
        chain.append(a.rollout_id)
        _running(ledger, a)
        recovery = failures.task_error("worker-0", a, RuntimeError("again"))
        a = recovery.dispatch[0] if recovery.dispatch else None
    assert len(chain) == 3
    assert [show(ledger, r)["rollout"]["attempt"] for r in chain] == [0, 1, 2]


def test_retries_off_end_without_retrying(ledger, job):
    planner, failures, out = _setup(ledger, job, retry_lost=False)
    _running(ledger, out[0])
    assert failures.task_error("w", out[0], RuntimeError()).dispatch == []


def test_a_dead_workers_rollouts_are_lost_requeued_or_kept_by_state(ledger, job):
    planner, failures, out = _setup(ledger, job, max_attempts=2)
    running, never_started, scored = out[0], out[1], out[2]
    _running(ledger, running, owner="worker-0")
    _running(ledger, scored, owner="worker-0")
    ledger.apply([Transition(scored.rollout_id, S.SCORED)])
    ledger.heartbeat("worker-0", job, 60)
    recovery = failures.worker_died("worker-0", [running, never_started, scored])
    assert recovery.ended == [running.rollout_id]
    assert ledger.rollout_state(running.rollout_id) == "failed_worker_lost"
    dispatched = {a.rollout_id for a in recovery.dispatch}
    assert never_started.rollout_id in dispatched and len(dispatched) == 2  # + the retry
    requeued = next(a for a in recovery.dispatch if a.rollout_id == never_started.rollout_id)
    assert requeued.session_id != never_started.session_id  # its old session was cancelled
    # Scored before the death: the trajectory is in the stream, so it stays scored.
    assert ledger.rollout_state(scored.rollout_id) == "scored"
    assert scored.rollout_id in planner.book.groups[scored.group_id].scored


def test_a_run_of_failed_rollouts_ends_the_job(ledger, job):
    planner, failures, out = _setup(ledger, job)
    failures.limit = 3
    for a in out[:2]:
        failures.rollout_failed(RolloutReport(a.rollout_id, "failed_sandbox"))
    with pytest.raises(SystematicFailure, match="failed_sandbox"):
        failures.rollout_failed(RolloutReport(out[2].rollout_id, "failed_sandbox"))
