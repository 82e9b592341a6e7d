"""Chaos, end to end: the job on a PostgreSQL ledger and a Redis stream (a server the test
starts itself, append-only) survives Redis killed and restarted, PostgreSQL restarted, and
its trainer actor killed. Each time the job completes, `lost` is 0, and the ledger shows
every trained rollout trained exactly once: the samples the trainer's steps report add up
to the `trained` rows, and the steps are contiguous (none repeated, none skipped).
The stop-then-resume case is in test_job_faults.py."""

from __future__ import annotations

import time

import pytest
import ray

from rlsys.actors.job import actor_name, run_job
from tests.e2e.accounting import assert_trained_exactly_once
from tests.e2e.services import (
    RedisServer,
    require_redis_server,
    require_restartable_postgres,
    restart_postgres,
)

pytestmark = [pytest.mark.e2e, pytest.mark.ray, pytest.mark.services]


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
            *sets,
        )

    return make


def test_redis_killed_and_restarted_and_postgres_restarted_lose_nothing(chaos_job, redis_server):
    require_restartable_postgres()
    cfg = chaos_job(3)
    done = []

    def on_step(m):
        if m["step"] == 1:  # Redis down for a while: workers' publishes and acks fail
            redis_server.kill()
            time.sleep(2.0)
            redis_server.start()  # the AOF brings back every entry and the group's state
            done.append("redis")
        elif m["step"] == 2:
            restart_postgres()
            done.append("postgres")

    summary = run_job(cfg, on_step=on_step, on_event=lambda s: None)
    assert done == ["redis", "postgres"]
    assert_trained_exactly_once(cfg, summary, 3)


def test_killed_trainer_is_replaced_and_trains_every_sample_once(chaos_job):
    cfg = chaos_job(3)

    def on_step(m):
        if m["step"] == 1:
            ray.kill(ray.get_actor(actor_name(m["job_id"], "trainer-0")), no_restart=True)

    summary = run_job(cfg, on_step=on_step, on_event=lambda s: None)
    assert summary["trainer_restarts"] == 1
    assert_trained_exactly_once(cfg, summary, 3)
