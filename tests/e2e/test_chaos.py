"""Chaos, end to end: the job on a PostgreSQL ledger and a Redis stream (a server the test
starts itself, append-only) meets each fault while a trainer step is in flight and
rollouts are being published (`StepInFlight`): Redis down for 5 s and until a client has
met the outage, Redis down past the workers' publish window, PostgreSQL restarted, the
trainer actor killed.
Each test checks that the job saw the fault (connection errors counted, the restart seen
by the driver, a trainer replaced) and that nothing was lost: the job completes, `lost`
is 0, and every trained rollout was trained exactly once (the samples the steps report add
up to the `trained` rows; the steps are contiguous). A missing service fails these tests
under RLSYS_REQUIRE_SERVICES. The stop-then-resume case is in test_job_faults.py.
"""

from __future__ import annotations

import time

import pytest
import ray
import sqlalchemy as sa

from rlsys.actors.job import actor_name, ledger_url_for, run_job
from rlsys.ledger.store import Ledger
from tests.e2e.accounting import assert_trained_exactly_once
from tests.e2e.fault_timing import StepInFlight
from tests.e2e.services import (
    RedisServer,
    require_redis_server,
    require_restartable_postgres,
    restart_postgres,
    stand_in_until_knocked,
)

pytestmark = [pytest.mark.e2e, pytest.mark.ray, pytest.mark.services]

OUTAGE_BOUND_S = 240.0  # the longest the long outage waits for a rollout to meet it


@pytest.fixture
def redis_server(tmp_path):
    require_redis_server()
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def chaos_job(tiny_job, pg_database_url, redis_server):
    def make(steps: int, *sets: str):
        return tiny_job(
            steps,
            f"store.ledger_url={pg_database_url}",
            f"store.stream_url={redis_server.url}",
            # a full window: workers are publishing while the trainer steps
            "rollout.groups_in_flight=6",
            *sets,
        )

    return make


def _run_with_fault(
    cfg, job_id: str, fault, min_steps: int = 1, max_steps: int | None = None
) -> tuple[dict, dict]:
    injector = StepInFlight(cfg.store.ledger_url, job_id, fault, min_steps, max_steps)
    injector.start()
    try:
        summary = run_job(cfg, job_id=job_id, on_event=lambda s: None)
    finally:
        injector.stop()
    assert injector.fired is not None, "the fault never found a step in flight"
    return summary, injector.fired


def _rows(cfg, sql: str, job_id: str) -> list[tuple]:
    lg = Ledger.open(ledger_url_for(cfg), create=False)
    try:
        with lg.engine.connect() as conn:
            return list(conn.execute(sa.text(sql), {"j": job_id}).all())
    finally:
        lg.close()


def test_a_five_second_redis_restart_mid_step_drops_nothing(chaos_job, redis_server):
    cfg = chaos_job(3)

    knocks: list[int] = []

    def restart_redis() -> None:
        # Down for 5 s, and on until a client (a publish, the trainer's read or ack) has met
        # the outage: on a loaded box a step can outlast 5 s with nothing touching the stream.
        redis_server.kill()
        try:
            knocks.append(stand_in_until_knocked(redis_server.port, 5.0, OUTAGE_BOUND_S))
        finally:
            redis_server.start()  # the AOF brings back every entry and the group's state

    summary, fired = _run_with_fault(cfg, "j-chaos-redis", restart_redis)
    met = summary["stream_retries"] + summary["step_retries"] + summary["ack_retries"]
    assert knocks and knocks[0] > 0, f"no client reached the stream while it was down ({fired})"
    assert met > 0  # the outage was met: a publish, a read or an ack failed and was retried
    assert summary["dropped"] == 0 and summary["terminal"]["failed_stream"] == 0
    assert_trained_exactly_once(cfg, summary, 3)


def test_a_redis_outage_past_the_publish_window_ends_rollouts_failed_stream(
    chaos_job, redis_server
):
    cfg = chaos_job(3, "store.stream_retry_s=1")
    failed_sql = "SELECT id, attempt FROM rollouts WHERE job_id = :j AND state = 'failed_stream'"

    def long_outage() -> None:
        # Down until a rollout has met the outage past its 1 s publish window (the ledger
        # shows it), however long rollouts take to finish on a loaded box; bounded.
        redis_server.kill()
        try:
            deadline = time.monotonic() + OUTAGE_BOUND_S
            while time.monotonic() < deadline and not _rows(cfg, failed_sql, "j-chaos-stream"):
                time.sleep(0.5)
        finally:
            redis_server.start()

    summary, fired = _run_with_fault(cfg, "j-chaos-stream", long_outage)
    failed = _rows(cfg, failed_sql, "j-chaos-stream")
    seen = {k: summary.get(k) for k in ("status", "end_reason", "terminal", "stream_retries")}
    retried = {
        r
        for (r,) in _rows(cfg, "SELECT retry_of FROM rollouts WHERE job_id = :j", "j-chaos-stream")
    }
    assert failed, f"no rollout met the outage (fired at {fired}; the job: {seen})"
    assert summary["terminal"]["failed_worker_lost"] == 0  # no worker died: never named so
    assert all(rid in retried for rid, attempt in failed if attempt == 0)  # linked retries
    assert_trained_exactly_once(cfg, summary, 3)


def test_postgres_restarted_mid_step_is_seen_and_loses_nothing(chaos_job):
    require_restartable_postgres()
    cfg = chaos_job(3)
    summary, _ = _run_with_fault(cfg, "j-chaos-pg", restart_postgres)
    assert summary["ledger_reconnects"] > 0  # the driver found its connections dead
    assert_trained_exactly_once(cfg, summary, 3)


def test_a_trainer_killed_mid_step_is_replaced_and_trains_every_sample_once(chaos_job):
    cfg = chaos_job(3)

    def kill_trainer() -> None:
        ray.kill(ray.get_actor(actor_name("j-chaos-trainer", "trainer-0")), no_restart=True)

    # Killed while step 2 is in flight, so step 3 is still to come: `ray.kill` is
    # asynchronous, and a trainer killed as the last step finishes can die after the
    # driver's last call to it, unseen (CI met that once).
    summary, fired = _run_with_fault(cfg, "j-chaos-trainer", kill_trainer, max_steps=1)
    assert summary["trainer_restarts"] == 1, f"fired at {fired}"

    assert_trained_exactly_once(cfg, summary, 3)
