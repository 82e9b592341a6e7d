"""`JobLifetime`: from the job's row to its one end, whatever leaves the block."""

import time

import pytest

from rlsys.control.job_end import JobEnd
from rlsys.control.job_lifetime import JobLifetime
from rlsys.ledger.queries import stats
from rlsys.ledger.records import PlannedRollout

pytestmark = pytest.mark.unit


def _job_with_live_rollouts(ledger) -> str:
    job = ledger.create_job("t", {})
    ledger.plan(job, [PlannedRollout("g", "t/1") for _ in range(3)])
    return job


def _ended(ledger, job: str) -> tuple[str, str]:
    row = ledger.get_job(job)
    assert stats(ledger, job)["lost"] == 0  # every rollout named
    return row["status"], row["end_reason"]


def test_a_crash_in_any_phase_ends_the_job_failed_naming_the_phase_and_propagates(ledger):
    job = _job_with_live_rollouts(ledger)
    with pytest.raises(RuntimeError, match="boom"), JobLifetime(ledger, job, 60.0) as life:
        life.phase("warm_start")
        raise RuntimeError("boom")
    status, reason = _ended(ledger, job)
    assert status == "failed" and reason == "RuntimeError: boom (during warm_start)"
    assert stats(ledger, job)["terminal"]["cancelled"] == 3


def test_an_interrupt_stops_the_job_and_a_named_end_keeps_its_status(ledger):
    job = _job_with_live_rollouts(ledger)
    with JobLifetime(ledger, job, 60.0) as life:
        life.phase("critic_pretrain")
        raise KeyboardInterrupt
    assert _ended(ledger, job) == (
        "stopped",
        "interrupted (SIGINT or SIGTERM) during critic_pretrain",
    )
    job = _job_with_live_rollouts(ledger)
    with JobLifetime(ledger, job, 60.0):
        raise JobEnd("completed", "solved: pass rate 1.000 >= 0.95")
    assert _ended(ledger, job) == ("completed", "solved: pass rate 1.000 >= 0.95")


def test_the_phase_hook_hears_each_phase_first_and_a_normal_exit_uses_the_end(ledger):
    job = _job_with_live_rollouts(ledger)
    heard = []
    with JobLifetime(ledger, job, 60.0, on_phase=heard.append) as life:
        life.phase("stream")
        life.phase("ray")
        life.end("completed", "3 steps")
    assert heard == ["stream", "ray"] and _ended(ledger, job) == ("completed", "3 steps")


def test_the_driver_renews_the_heartbeat_while_the_job_runs(ledger):
    job = _job_with_live_rollouts(ledger)
    first = ledger.get_job(job)["heartbeat_at"]
    with JobLifetime(ledger, job, driver_timeout_s=0.6) as life:  # a beat every 0.1 s
        deadline = time.monotonic() + 30
        while ledger.get_job(job)["heartbeat_at"] <= first + 0.2:
            assert time.monotonic() < deadline, "no heartbeat renewed the job"
            time.sleep(0.05)
        life.end("completed", "done")
    life._beat.join(timeout=30)  # ended: the heartbeat thread is gone
    assert not life._beat.is_alive()
