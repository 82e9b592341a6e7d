import time

import pytest

from rlsys.ledger.queries import show, stats
from rlsys.ledger.reconcile import finish_job, reconcile_leases, reconcile_rollouts
from rlsys.types import RolloutState as S
from tests.ledger.helpers import advance, planned_job

pytestmark = pytest.mark.services

RUNNING = (S.ADMITTED, S.RUNNING)


def test_lapsed_owner_rollouts_become_worker_lost_with_linked_retries(ledger):
    job, ids = planned_job(ledger, 4)
    advance(ledger, ids[:2], RUNNING, owner="dead")
    advance(ledger, ids[2:], RUNNING, owner="alive")
    ledger.heartbeat("dead", job, lease_s=0.01)
    ledger.heartbeat("alive", job, lease_s=60)
    time.sleep(0.05)
    result = reconcile_leases(ledger, job, retry=True, max_attempts=2)
    assert sorted(result.lost) == sorted(ids[:2])
    assert [ledger.rollout_state(r) for r in ids] == ["failed_worker_lost"] * 2 + ["running"] * 2
    for old, new in result.retries.items():
        record = show(ledger, new)
        assert record["rollout"]["retry_of"] == old and record["rollout"]["attempt"] == 1
        assert record["rollout"]["state"] == "planned"
        assert show(ledger, old)["retried_as"] == [new]
        assert [e["kind"] for e in record["events"]] == ["retry_of"]


def test_live_owner_keeps_its_rollouts(ledger):
    job, ids = planned_job(ledger, 2)
    advance(ledger, ids, RUNNING, owner="w")
    ledger.heartbeat("w", job, lease_s=60)
    assert reconcile_leases(ledger, job).lost == []


def test_retry_budget_is_respected(ledger):
    job, (rid,) = planned_job(ledger, 1)
    advance(ledger, [rid], RUNNING, owner="w")
    ledger.release("w")
    assert reconcile_leases(ledger, job, retry=True, max_attempts=1).retries == {}


def test_finish_job_names_every_live_rollout(ledger):
    job, ids = planned_job(ledger, 5)
    advance(ledger, ids[:1])
    ledger.transition(ids[0], S.TRAINED)
    advance(ledger, ids[1:3], RUNNING, owner="gone")
    ledger.release("gone")
    assert stats(ledger, job)["in_flight"] == 4
    assert finish_job(ledger, job, "completed") == 4
    out = stats(ledger, job)
    assert out["lost"] == 0 and out["in_flight"] == 0
    assert out["terminal"]["failed_worker_lost"] == 2
    assert out["terminal"]["cancelled"] == 2
    assert out["job_status"] == "completed"


def test_stopping_a_job_cancels_in_flight_rollouts(ledger):
    job, ids = planned_job(ledger, 3)
    advance(ledger, ids, RUNNING, owner="w")
    ledger.heartbeat("w", job, lease_s=60)
    finish_job(ledger, job, "stopped")
    assert [ledger.rollout_state(r) for r in ids] == ["cancelled"] * 3
    assert stats(ledger, job)["lost"] == 0


def test_scored_rollouts_survive_their_workers_death(ledger):
    """Once scored, a rollout is in the stream: a lapsed worker lease must not end it."""
    job, ids = planned_job(ledger, 2)
    advance(ledger, ids, RUNNING, owner="w")
    ledger.transition(ids[0], S.SCORED, reward=1.0)
    ledger.release("w")
    assert reconcile_leases(ledger, job).lost == [ids[1]]
    assert ledger.rollout_state(ids[0]) == "scored"


def test_retry_of_a_retry_uses_up_the_attempt_budget(ledger):
    job, (rid,) = planned_job(ledger, 1)
    chain = [rid]
    for _ in range(3):
        advance(ledger, [chain[-1]], RUNNING, owner="w")
        result = reconcile_rollouts(
            ledger, job, [chain[-1]], S.FAILED_WORKER_LOST, "task error", retry=True,
            max_attempts=3,
        )  # fmt: skip
        assert result.lost == [chain[-1]]
        chain += result.retries.values()
    assert len(chain) == 3  # attempts 0, 1, 2: the third failure plans no fourth
    assert [show(ledger, r)["rollout"]["attempt"] for r in chain] == [0, 1, 2]
    assert show(ledger, chain[2])["rollout"]["retry_of"] == chain[1]


def test_reconcile_rollouts_leaves_scored_and_terminal_rollouts_alone(ledger):
    job, ids = planned_job(ledger, 3)
    advance(ledger, ids[:1], (S.ADMITTED, S.RUNNING, S.SCORED))
    advance(ledger, ids[1:2], RUNNING, owner="w")
    result = reconcile_rollouts(ledger, job, ids[:2], S.FAILED_WORKER_LOST, "x", retry=True)
    assert result.lost == [ids[1]]
    assert ledger.rollout_state(ids[0]) == "scored"


def test_stopped_job_parks_scored_rollouts_instead_of_cancelling_them(ledger):
    job, ids = planned_job(ledger, 3)
    advance(ledger, ids[:1], (S.ADMITTED, S.RUNNING, S.SCORED))  # its trajectory: in the stream
    advance(ledger, ids[1:2], RUNNING, owner="w")
    assert finish_job(ledger, job, "stopped") == 2
    out = stats(ledger, job)
    assert ledger.rollout_state(ids[0]) == "scored"
    assert out["parked"] == 1 and out["lost"] == 0 and out["terminal"]["cancelled"] == 2
