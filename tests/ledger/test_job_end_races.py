"""Ending a job while its workers still end rollouts, and reaping a job whose driver died.

`finish_job` decides each live rollout's end from its state; workers cancelled a moment
before may still end rollouts between that read and the write. The live rows are read
locked, so the job ends whole (no conflict rolls it back), and every rollout has exactly
one terminal state, whoever wrote it.
"""

from __future__ import annotations

import threading
import time

import pytest
import sqlalchemy as sa

from rlsys.ledger.errors import TransitionConflict
from rlsys.ledger.liveness import JobNotOrphaned, effective_status
from rlsys.ledger.queries import stats
from rlsys.ledger.reconcile import finish_job, reap_job
from rlsys.ledger.store import Ledger
from rlsys.types import RolloutState as S
from tests.ledger.helpers import advance, planned_job

pytestmark = pytest.mark.services

ROLLOUTS = 600
WORKERS = 3


def _worker(url: str, ids: list[str], start: threading.Event, ended: list[str]) -> None:
    """End rollouts one by one, as workers finishing after a cancel do."""
    ledger = Ledger.open(url, create=False)
    start.wait()
    for i, rid in enumerate(ids):
        try:
            ledger.transition(rid, S.SCORED if i % 2 else S.FAILED_ENGINE, reason="late worker")
            ended.append(rid)
        except TransitionConflict:
            pass  # the job's end got there first
    ledger.close()


def test_a_job_ends_whole_while_workers_keep_ending_its_rollouts(ledger, ledger_url):
    job, ids = planned_job(ledger, ROLLOUTS)
    advance(ledger, ids, states=(S.ADMITTED, S.RUNNING))
    start, ended = threading.Event(), []
    shares = [ids[k::WORKERS] for k in range(WORKERS)]
    threads = [
        threading.Thread(target=_worker, args=(ledger_url, share, start, ended)) for share in shares
    ]
    for t in threads:
        t.start()
    start.set()
    # The job ends in the middle of the workers: once each has ended some (a fixed pause
    # was too short on a loaded box, and the job's end then named all of them first).
    deadline = time.monotonic() + 120
    while len(ended) < 2 * WORKERS and time.monotonic() < deadline:
        time.sleep(0.001)
    assert ended, "no worker ended a rollout within 120 s"
    named = finish_job(ledger, job, "completed", "test")
    for t in threads:
        t.join(timeout=120)
    with ledger.engine.connect() as conn:
        live = conn.execute(
            sa.text(
                "SELECT count(*) FROM rollouts WHERE job_id = :j AND state IN "
                "('planned','admitted','running','scored','buffered')"
            ),
            {"j": job},
        ).scalar_one()
        terminal_rows = dict(
            conn.execute(
                sa.text(
                    "SELECT rollout_id, count(*) FROM rollout_transitions WHERE is_terminal "
                    "GROUP BY rollout_id"
                )
            ).all()
        )
    assert 0 < named < ROLLOUTS and ended  # both sides ended some: they did overlap
    assert live == 0 and len(terminal_rows) == ROLLOUTS
    assert set(terminal_rows.values()) == {1}
    assert ledger.get_job(job)["status"] == "completed"
    assert stats(ledger, job)["lost"] == 0


def test_an_orphaned_job_counts_its_live_rollouts_lost_until_reaped(ledger):
    job, ids = planned_job(ledger, 8)
    advance(ledger, ids[:4], states=(S.ADMITTED, S.RUNNING, S.SCORED))
    now = time.time()
    with pytest.raises(JobNotOrphaned, match="driver beat"):
        reap_job(ledger, job)  # its driver beat a moment ago
    later = now + 61  # the default driver timeout is 60 s
    assert effective_status(ledger.get_job(job), later) == "orphaned"
    with ledger.engine.begin() as conn:  # the driver's last beat, 61 s ago
        conn.execute(sa.text("UPDATE jobs SET heartbeat_at = :t"), {"t": now - 61})
    before = stats(ledger, job)
    assert before["job_status"] == "orphaned"
    assert before["lost"] == 8 and before["in_flight"] == 0
    assert reap_job(ledger, job) == 8
    after = stats(ledger, job)
    assert after["job_status"] == "failed" and after["lost"] == 0
    assert after["terminal"]["failed_driver_lost"] == 8
    assert "driver lost" in after["end_reason"]
    with pytest.raises(JobNotOrphaned, match="already ended"):
        reap_job(ledger, job)


def test_the_new_terminal_states_are_final_in_the_database(ledger):
    job, ids = planned_job(ledger, 2)
    advance(ledger, ids, states=(S.ADMITTED, S.RUNNING))
    ledger.transition(ids[0], S.FAILED_STREAM, reason="stream down")
    ledger.transition(ids[1], S.FAILED_DRIVER_LOST, reason="driver gone")
    for rid in ids:  # behind the state machine's back: the trigger refuses
        with pytest.raises(sa.exc.DatabaseError), ledger.engine.begin() as conn:
            conn.execute(sa.text("UPDATE rollouts SET state = 'running' WHERE id = :r"), {"r": rid})
