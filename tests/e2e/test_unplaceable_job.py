"""A job whose actors no node can host ends `failed` with the field named, and never hangs.

Without the placement check an engine replica that asks for a resource no node offers
waits in Ray's PENDING_CREATION forever, and so does the driver that waits for it to be
ready (its heartbeat keeps the job `running`): this test would time out.
"""

import pytest

from rlsys.actors.job import ledger_url_for, run_job
from rlsys.ledger.store import Ledger

pytestmark = [pytest.mark.e2e, pytest.mark.ray]


def test_a_job_that_cannot_be_placed_ends_failed_before_any_actor_starts(tiny_job) -> None:
    cfg = tiny_job(2, "engine.placement.resources={tpu_slice: 1}")
    summary = run_job(cfg, on_event=lambda s: None)
    assert summary["status"] == "failed" and summary["steps"] == []
    reason = summary["end_reason"]
    assert reason.startswith("cannot place the job's actors: "), reason
    assert "tpu_slice 1" in reason and "engine.placement.num_cpus / num_gpus / resources" in reason
    ledger = Ledger.open(ledger_url_for(cfg))
    try:
        job = ledger.get_job(summary["job_id"])
        assert job["status"] == "failed" and job["end_reason"] == reason
    finally:
        ledger.close()


def test_on_a_cluster_that_may_grow_the_wait_for_actors_is_bounded(tiny_job) -> None:
    import ray

    # joined (an address given): an autoscaler might add a node with the resource, so the
    # job is warned and waits, until store.start_timeout_s ends it naming the replicas
    cfg = tiny_job(2, "engine.placement.resources={tpu_slice: 1}", "store.start_timeout_s=3")
    heard: list[str] = []
    address = ray.get_runtime_context().gcs_address
    summary = run_job(cfg, address=address, on_event=heard.append)
    assert any("wait for an autoscaler" in line and "tpu_slice 1" in line for line in heard)
    assert summary["status"] == "failed" and summary["steps"] == []
    reason = summary["end_reason"]
    assert reason.startswith("actors not ready within store.start_timeout_s (3 s): "), reason
    # the replicas can never be ready; the trainer and workers may still be loading at 3 s
    pending = reason.split(": ", 1)[1].removesuffix(" (not placed, or still loading)")
    assert {"replica-0", "replica-1"} <= set(pending.split(", ")), reason
    # every actor the job started was killed: none is left pending or alive under its name
    alive = [
        a for a in ray.util.list_named_actors(all_namespaces=True) if summary["job_id"] in a["name"]
    ]
    assert alive == []
