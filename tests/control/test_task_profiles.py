"""Per-prompt task profiles (`TaskProfiles`): what steers which prompts a job draws."""

import random

import pytest

from rlsys.config.curriculum import CurriculumConfig
from rlsys.control.task_profiles import TaskProfiles

pytestmark = pytest.mark.unit


def _profiles(group_size: int = 4, **cfg: object) -> TaskProfiles:
    config = CurriculumConfig.model_validate({"task_set": 10, **cfg})
    return TaskProfiles(config, group_size, random.Random(0))


def test_a_prompt_whose_recent_rollouts_all_passed_retires_and_is_never_drawn():
    p = _profiles()
    for _ in range(4):
        p.record(3, 1.0)
    assert 3 in p.retired and p.weights()[3] == 0.0
    assert 3 not in {p.draw() for _ in range(500)}
    assert p.mix()["retired"] == 1


def test_a_prompt_that_always_fails_is_drawn_rarely_but_still_drawn():
    p = _profiles()
    for _ in range(8):
        p.record(5, 0.0)
    for i in (1, 2):  # two prompts with mixed results: the most informative
        p.record(i, 1.0)
        p.record(i, 0.0)
    w = p.weights()
    assert w[5] == pytest.approx(0.05) and min(w[1], w[2]) > 10 * w[5]
    draws = [p.draw() for _ in range(4000)]
    assert 0 < draws.count(5) < draws.count(1) / 5
    assert p.mix()["rare"] == 1


def test_steering_prefers_prompts_whose_groups_disagree_and_off_draws_uniformly():
    p = _profiles()
    for i in range(5):  # prompts 0-4 nearly solved, 5-9 mixed
        p.record(i, 1.0)
        p.record(i, 1.0)
        p.record(i, 1.0)
    for i in range(5, 10):
        p.record(i, 1.0)
        p.record(i, 0.0)
    draws = [p.draw() for _ in range(4000)]
    mixed = sum(d >= 5 for d in draws)
    assert mixed > 0.7 * len(draws)  # weights 0.81 vs 0.28 a prompt
    off = _profiles(steer=False)
    off.recent, off.retired = p.recent, p.retired
    draws = [off.draw() for _ in range(4000)]
    assert 0.4 < sum(d >= 5 for d in draws) / len(draws) < 0.6


def test_the_task_set_pass_rate_counts_untried_prompts_as_failing_and_solved_ends_it():
    p = _profiles(solved_pass_rate=0.9)
    assert p.pass_rate() == 0.0 and not p.solved()
    for i in range(9):
        for _ in range(4):
            p.record(i, 1.0)
    assert p.pass_rate() == pytest.approx(0.9) and p.solved()
    off = _profiles(solved_pass_rate=None)
    off.recent, off.retired = p.recent, p.retired
    assert not off.solved()


def test_without_a_task_set_the_pass_rate_is_over_the_last_rollouts():
    config = CurriculumConfig(solved_window=4, solved_pass_rate=0.75)
    p = TaskProfiles(config, 4, random.Random(0))
    for r in (0.0, 1.0, 1.0):
        p.record(p.draw(), r)
    assert p.pass_rate() is None  # fewer than solved_window rollouts
    p.record(p.draw(), 1.0)
    assert p.pass_rate() == 0.75 and p.solved()
    assert p.mix() == {}


def test_profiles_rebuilt_from_history_draw_what_the_live_ones_would():
    history = [(i % 10, float(i % 3 == 0)) for i in range(60)]
    live = _profiles()
    for index, reward in history:
        live.record(index, reward)
    rebuilt = TaskProfiles.from_history(live.cfg, 4, random.Random(0), history)
    assert rebuilt.weights() == live.weights() and rebuilt.retired == live.retired


def test_a_retire_window_longer_than_the_profile_is_refused():
    with pytest.raises(ValueError, match="retire_after"):
        CurriculumConfig(window=4, retire_after=5)


def test_the_fresh_pass_rate_counts_only_a_prompts_first_group():
    p = _profiles(group_size=2)
    assert p.fresh_pass_rate() is None
    for r in (1.0, 0.0):  # prompt 1's first group
        p.record(1, r)
    for _ in range(6):  # its revisits: not fresh
        p.record(1, 1.0)
    assert p.fresh_pass_rate() == 0.5
