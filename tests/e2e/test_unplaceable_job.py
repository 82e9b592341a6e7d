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
