"""Per-rollout profiles and per-group reward variance (discriminativeness)."""

import pytest

from rlsys.rollout.profile import discriminativeness, group_reward_stats
from rlsys.rollout.tasks.registry import build_task, parse_task_config

pytestmark = pytest.mark.unit


def test_group_variance_says_whether_a_group_discriminates():
    mixed = group_reward_stats([1.0, 0.0, 1.0, 0.0])
    same = group_reward_stats([1.0, 1.0, 1.0])
    assert (mixed.mean, mixed.variance, mixed.discriminative) == (0.5, 0.25, True)
    assert (same.variance, same.discriminative) == (0.0, False)
    assert not group_reward_stats([0.7]).discriminative
    assert group_reward_stats([]).size == 0


def test_discriminativeness_summarises_groups():
    summary = discriminativeness(
        {"a": [0.0, 1.0], "b": [0.0, 0.0], "c": [1.0, 1.0], "d": [0.0, 0.5]}
    )
    assert summary["groups"] == 4 and summary["discriminative_fraction"] == 0.5
    assert summary["mean_variance"] == pytest.approx((0.25 + 0.0625) / 4)


def test_task_registry_builds_from_config_and_rejects_unknown_fields():
    task = build_task(parse_task_config({"type": "arithmetic", "max_factor": 9}))
    assert all(task.instance(i).data["a"] <= 9 for i in range(50))
    assert build_task("code").name == "code"
    with pytest.raises(ValueError, match="hidden_tests"):
        parse_task_config({"type": "code", "hidden_tests": 3})
    with pytest.raises(ValueError):
        parse_task_config({"type": "chess"})


def test_instances_are_a_pure_function_of_the_index():
    for name in ("arithmetic", "code"):
        assert build_task(name).instance(5) == build_task(name).instance(5)
    prompts = {build_task("arithmetic").instance(i).prompt for i in range(200)}
    assert len(prompts) > 190
