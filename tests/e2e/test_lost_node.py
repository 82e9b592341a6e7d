"""A whole node lost mid-job, on a multi-node Ray cluster on this machine.

`ray.cluster_utils.Cluster` runs a head and two more raylets; custom resources put the
engine replicas and the trainer on the head and the rollout workers on the two worker
nodes. When worker-0 is mid-rollout its node is removed (raylet and every process on it):
the job completes, the lost rollouts end `failed_worker_lost` each with a linked retry,
replacements land on the surviving node, `lost` is 0 and every sample is trained once.
"""

from __future__ import annotations

import pytest
import ray
import sqlalchemy as sa

from rlsys.actors.job import actor_name, ledger_url_for, run_job
from rlsys.ledger.store import Ledger
from tests.e2e.accounting import assert_trained_exactly_once

pytestmark = [pytest.mark.e2e, pytest.mark.ray]


@pytest.fixture
def cluster():
    from ray.cluster_utils import Cluster

    if ray.is_initialized():  # the single-node cluster of earlier e2e tests
        ray.shutdown()
    c = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 4, "resources": {"engine_node": 4}},
    )
    workers = [c.add_node(num_cpus=2, resources={"rollout_node": 2}) for _ in range(2)]
    ray.init(address=c.address, log_to_driver=False)
    yield c, workers
    ray.shutdown()
    c.shutdown()


def _node_of(actor) -> str:
    return ray.get(actor.__ray_call__.remote(lambda _self: ray.get_runtime_context().get_node_id()))


def test_a_removed_node_loses_no_rollout(tiny_job, cluster):
    c, nodes = cluster
    cfg = tiny_job(
        3,
        "rollout.resources={rollout_node: 1}",
        "engine.resources={engine_node: 1}",
        "trainer.resources={engine_node: 1}",
        "rollout.groups_in_flight=6",
        # Each action answered after 1 s: worker-0 is mid-rollout when its node goes.
        "rollout.scaffold.tool_latency.median_s=1.0",
        "rollout.scaffold.tool_latency.sigma=0",
    )
    removed = []

    def on_step(m):
        if m["step"] == 1:
            node_id = _node_of(ray.get_actor(actor_name(m["job_id"], "worker-0")))
            node = next(n for n in nodes if n.node_id == node_id)
            c.remove_node(node, allow_graceful=False)
            removed.append(node_id)

    summary = run_job(cfg, on_step=on_step, on_event=lambda s: None)
    assert removed and summary["worker_deaths"] >= 1
    assert_trained_exactly_once(cfg, summary, 3)
    lg = Ledger.open(ledger_url_for(cfg), create=False)
    with lg.engine.connect() as conn:
        lost = conn.execute(
            sa.text("SELECT id, reason FROM rollouts WHERE state = 'failed_worker_lost'")
        ).all()
        retried = set(
            conn.execute(sa.text("SELECT retry_of FROM rollouts WHERE retry_of IS NOT NULL"))
            .scalars()
            .all()
        )
    lg.close()
    assert lost, "worker-0 had rollouts in flight on the removed node"
    assert {rid for rid, _ in lost} == retried  # each lost rollout has its linked retry
