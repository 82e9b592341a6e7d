"""Async and sync pipelines on a local Ray cluster, with long-tailed environment latency:
sync trains only on samples of the newest weights; async overlaps generation and training
and holds a step for a straggler rather than letting it go past the staleness bound."""

import pytest

from rlsys.actors.job import run_job

pytestmark = [pytest.mark.e2e, pytest.mark.ray]

LATENCY = (
    "rollout.scaffold.tool_latency.median_s=0.05",
    "rollout.scaffold.tool_latency.sigma=1.5",
    "rollout.scaffold.tool_latency.max_s=3",
    "algo.filter_zero_variance=false",
)


@pytest.mark.parametrize("pipeline", ["sync", "async"])
def test_pipelines_respect_the_staleness_bound_and_account_for_everything(tiny_job, pipeline):
    sets = (*LATENCY, f"rollout.pipeline={pipeline}", "algo.max_staleness=1")
    cfg = tiny_job(4, *sets)
    summary = run_job(cfg, on_event=lambda s: None)
    assert summary["status"] == "completed" and len(summary["steps"]) == 4
    assert summary["lost"] == 0 and summary["in_flight"] == 0
    assert summary["stale_filtered"] == 0
    # The serving side at each step: both replicas report, and later turns of a rollout hit
    # the prefix cache (its earlier turns are their prompt's prefix).
    serving = [m["serving"] for m in summary["steps"]]
    assert all(s["replicas_reporting"] == 2 and s["queue_depth"] >= 0 for s in serving)
    assert 0 < serving[-1]["prefix_cache_hit_rate"] <= 1 and serving[-1]["grants"] > 0
    staleness = [m["staleness"]["max"] for m in summary["steps"]]
    if pipeline == "sync":
        assert staleness == [0, 0, 0, 0] and summary["staleness_holds"] == 0
    else:
        assert max(staleness) <= 1
