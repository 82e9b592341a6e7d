"""What a job asks of the cluster, and the two necessary conditions a placement must meet
(`rlsys.actors.placement`); the job-level end is `tests/e2e/test_unplaceable_job.py`."""

from __future__ import annotations

import pytest

from rlsys.actors.placement import Demand, check_placement, job_demands, unplaceable
from rlsys.config.job import JobConfig
from rlsys.control.job_end import JobEnd

LAPTOP = [{"CPU": 8.0, "memory": 1e10}]
TWO_GPU_NODES = [{"CPU": 16.0, "GPU": 1.0}, {"CPU": 16.0, "GPU": 1.0}]


def _cfg(**sections: dict) -> JobConfig:
    return JobConfig.model_validate({"model": {"preset": "tiny"}, **sections})


@pytest.mark.unit
def test_the_default_job_fits_a_laptop() -> None:
    assert unplaceable(job_demands(_cfg()), LAPTOP) == []


@pytest.mark.unit
def test_a_gpu_asked_of_a_cpu_cluster_is_named() -> None:
    cfg = _cfg(trainer={"num_gpus": 1})
    reasons = unplaceable(job_demands(cfg), LAPTOP)
    assert len(reasons) == 2  # no node has a GPU, and the cluster has none in total
    assert "trainer.num_cpus / num_gpus / resources" in reasons[0] and "GPU 1" in reasons[0]
    assert "the cluster has 0" in reasons[1]


@pytest.mark.unit
def test_every_node_must_host_one_actor_whole() -> None:
    # two GPUs in the cluster, but no node with two for one replica
    cfg = _cfg(engine={"placement": {"replicas": 1, "num_gpus": 2}})
    reasons = unplaceable(job_demands(cfg), TWO_GPU_NODES)
    assert len(reasons) == 1 and "engine.placement" in reasons[0]
    assert reasons[0].endswith("the largest node has CPU 16, GPU 1")


@pytest.mark.unit
def test_the_totals_count_every_rank_and_replica() -> None:
    # each actor fits a node, all together do not: 2 trainer ranks + 2 replicas of 1 GPU
    cfg = _cfg(
        trainer={"num_gpus": 1, "data_parallel": 2},
        engine={"placement": {"replicas": 2, "num_gpus": 1}},
    )
    reasons = unplaceable(job_demands(cfg), TWO_GPU_NODES)
    assert reasons == [
        "the job asks for 4 GPU (2 trainer rank(s) x 1 + 2 engine replica(s) x 1); "
        "the cluster has 2"
    ]
    # fractions share a GPU: a trainer and two replicas on one GPU fit
    shared = _cfg(trainer={"num_gpus": 0.5}, engine={"placement": {"num_gpus": 0.25}})
    assert unplaceable(job_demands(shared), [{"CPU": 8.0, "GPU": 1.0}]) == []


@pytest.mark.unit
def test_a_growing_cluster_is_warned_a_fixed_one_ends_the_job() -> None:
    cfg = _cfg(rollout={"resources": {"sandbox_node": 1}})
    heard: list[str] = []
    check_placement(cfg, can_grow=True, nodes=LAPTOP, on_event=heard.append)
    assert len(heard) == 1 and "rollout.num_cpus / resources" in heard[0]
    with pytest.raises(JobEnd) as ended:
        check_placement(cfg, can_grow=False, nodes=LAPTOP)
    assert ended.value.status == "failed" and "sandbox_node 1" in ended.value.reason
    zero = Demand("worker", 0, {"sandbox_node": 1.0}, "rollout.workers")
    assert unplaceable([zero], LAPTOP) == []  # no actor of the role, nothing to place
