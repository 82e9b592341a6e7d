"""The main job on a local Ray cluster: it completes, accounts for every rollout, survives
a killed rollout worker and a killed engine replica, and stops and resumes without losing or
repeating a trained sample."""

import pytest
import ray
import sqlalchemy as sa

from rlsys.actors.job import actor_name, ledger_url_for, run_job
from rlsys.ledger.store import Ledger
from tests.e2e.accounting import assert_trained_exactly_once

pytestmark = [pytest.mark.e2e, pytest.mark.ray]


def _rows(cfg, sql):
    lg = Ledger.open(ledger_url_for(cfg), create=False)
    try:
        with lg.engine.connect() as conn:
            return conn.execute(sa.text(sql)).all()
    finally:
        lg.close()


def test_killed_worker_and_replica_lose_nothing(tiny_job):
    # A full window, and an environment that answers each action after 1 s, so the worker
    # is mid-rollout when it is killed (the tiny model's rollouts otherwise all finish
    # while step 1 trains, and the kill would find it idle).
    cfg = tiny_job(
        4,
        "rollout.groups_in_flight=6",
        "rollout.scaffold.tool_latency.median_s=1.0",
        "rollout.scaffold.tool_latency.sigma=0",
    )
    killed = {}

    def on_step(m):
        if m["step"] == 1:
            job = m["job_id"]
            for role in ("worker-0", "replica-0"):
                ray.kill(ray.get_actor(actor_name(job, role)), no_restart=True)
                killed[role] = True

    summary = run_job(cfg, on_step=on_step, on_event=lambda s: None)
    assert killed == {"worker-0": True, "replica-0": True}
    assert summary["status"] == "completed" and len(summary["steps"]) == 4
    assert summary["lost"] == 0 and summary["in_flight"] == 0
    assert summary["worker_deaths"] == 1
    lost = _rows(cfg, "SELECT id FROM rollouts WHERE state = 'failed_worker_lost'")
    assert lost, "the killed worker had rollouts in flight"
    retries = dict(_rows(cfg, "SELECT retry_of, state FROM rollouts WHERE retry_of IS NOT NULL"))
    assert {rid for (rid,) in lost} == set(retries)
    reasons = _rows(cfg, "SELECT reason FROM rollouts WHERE state = 'failed_worker_lost'")
    assert all("worker-0" in r for (r,) in reasons)  # the lapsed lease, or the lost hand-over
    live = _rows(
        cfg,
        "SELECT count(*) FROM rollouts WHERE state IN "
        "('planned','admitted','running','scored','buffered')",
    )
    assert live == [(0,)]


def test_stop_then_resume_trains_the_parked_rollouts_exactly_once(tiny_job):
    cfg = tiny_job(steps=4)

    def stop_after_two(m):
        if m["step"] == 2:
            lg = Ledger.open(ledger_url_for(cfg), create=False)
            lg.set_job_status(m["job_id"], "stopping")
            lg.close()

    first = run_job(cfg, on_step=stop_after_two, on_event=lambda s: None)
    assert first["status"] == "stopped" and first["lost"] == 0
    # Scored rollouts wait in the (durable, cross-process) stream instead of being cancelled.
    parked = _rows(cfg, "SELECT id FROM rollouts WHERE state IN ('scored', 'buffered')")
    assert first["parked"] == len(parked) > 0
    second = run_job(cfg, resume=first["job_id"], on_event=lambda s: None)
    assert_trained_exactly_once(cfg, second, 4)
    ends = dict(_rows(cfg, "SELECT id, state FROM rollouts"))
    assert {ends[rid] for (rid,) in parked} <= {
        "trained",
        "filtered_zero_variance",
        "filtered_stale",
    }
    steps = _rows(cfg, "SELECT step, policy_version FROM trainer_steps ORDER BY step")
    assert [v for _, v in steps] == [1, 2, 3, 4]  # resumed at step 3, no step repeated
