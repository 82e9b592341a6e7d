"""Planning and the staleness gate (`Planner`), against a real SQLite ledger."""

import pytest

from rlsys.control.planner import Planner
from tests.control.conftest import job_config

pytestmark = pytest.mark.unit


def _sifted(planner: Planner) -> Planner:
    planner.sift()
    return planner


def test_groups_are_planned_in_the_ledger_before_they_are_handed_out(ledger, job):
    planner = Planner(job_config(), job, ledger)
    out = planner.plan(step=0, training=False)
    assert len(out) == 4 * 2  # the window: groups_in_flight groups of group_size
    assert {ledger.rollout_state(a.rollout_id) for a in out} == {"planned"}
    assert planner.plan(step=0, training=False) == []  # the window is full


def test_the_group_being_trained_counts_in_the_window_and_sync_waits(ledger, job):
    planner = Planner(job_config(), job, ledger)
    assert len(planner.plan(step=0, training=True)) == 2 * 2
    sync = Planner(job_config(pipeline="sync"), job, ledger)
    assert sync.plan(step=0, training=True) == []
    assert len(sync.plan(step=0, training=False)) == 2 * 2  # one step's groups


def test_only_what_the_remaining_steps_consume_is_planned(ledger, job):
    planner = Planner(job_config(), job, ledger)
    assert len(planner.plan(step=9, training=False)) == 2 * 2  # one step left: 2 groups


def test_a_step_waits_for_a_straggler_that_would_go_stale(ledger, job):
    planner = Planner(job_config(), job, ledger)
    out = planner.plan(step=0, training=False)
    groups = list(planner.book.groups.values())
    for a in out[2:6]:  # groups 1 and 2 ready; group 0 (the oldest) still generating
        planner.book.scored(a.rollout_id)
    planner.version = 0
    assert [g.group_id for g in _sifted(planner).next_batch()] == [
        groups[1].group_id,
        groups[2].group_id,
    ]
    planner.version = 1  # the next step makes version 2: group 0 (version 0) would be stale
    more = planner.plan(step=1, training=False)  # two groups at version 1
    for a in out[6:] + more[:2]:
        planner.book.scored(a.rollout_id)
    assert _sifted(planner).next_batch() is None and planner.staleness_holds == 1
    for a in out[:2]:
        planner.book.scored(a.rollout_id)
    assert _sifted(planner).next_batch() is not None  # the straggler arrived: the step goes ahead


def test_a_step_is_not_held_when_the_gate_is_off(ledger, job):
    # The feature off (max_staleness large): the same situation does not wait.
    planner = Planner(job_config(), job, ledger)
    planner.cfg.algo.max_staleness = 100
    out = planner.plan(step=0, training=False)
    for a in out[2:]:
        planner.book.scored(a.rollout_id)
    planner.version = 5
    assert _sifted(planner).next_batch() is not None


def test_parked_rollouts_of_a_resumed_job_come_back_ready(ledger, job):
    planner = Planner(job_config(), job, ledger)
    rows = [("r1", "g1", "scored", 3), ("r2", "g1", "buffered", 2), ("r3", "g2", "scored", 4)]
    assert planner.adopt_parked(rows) == 2
    batch = _sifted(planner).next_batch()
    assert batch is not None and {r for g in batch for r in g.scored} == {"r1", "r2", "r3"}


def _score(planner: Planner, assignments, rewards) -> None:
    from rlsys.control.messages import RolloutReport

    for a, r in zip(assignments, rewards, strict=True):
        planner.scored(RolloutReport(a.rollout_id, "scored", "0-1", reward=r))


def test_a_group_without_signal_leaves_the_book_and_a_new_one_takes_its_place(ledger, job):
    planner = Planner(job_config(), job, ledger)
    out = planner.plan(step=0, training=False)  # 4 groups of 2
    _score(planner, out[:2], [1.0, 1.0])  # no signal
    _score(planner, out[2:4], [1.0, 0.0])  # signal
    dropped = planner.sift()
    assert [sorted(g.members) for g, _ in dropped] == [sorted(a.rollout_id for a in out[:2])]
    assert "all 2 rewards = 1.0" in dropped[0][1]
    assert len(planner.plan(step=0, training=False)) == 2  # the window refilled
    assert planner.window.zero_variance_groups == 1 and planner.window.groups == 2


def test_a_penalised_turn_keeps_a_group_and_the_filter_off_keeps_all(ledger, job):
    from rlsys.control.messages import RolloutReport

    planner = Planner(job_config(), job, ledger)
    out = planner.plan(step=0, training=False)
    planner.scored(RolloutReport(out[0].rollout_id, "scored", reward=0.0, penalised=True))
    planner.scored(RolloutReport(out[1].rollout_id, "scored", reward=0.0))
    assert planner.sift() == []
    off = Planner(job_config(), job, ledger)
    off.cfg.algo.filter_zero_variance = False
    out = off.plan(step=0, training=False)
    _score(off, out[:2], [0.0, 0.0])
    assert off.sift() == []


def test_a_step_trains_only_informative_groups_and_waits_for_enough(ledger, job):
    planner = Planner(job_config(), job, ledger)
    out = planner.plan(step=0, training=False)
    _score(planner, out[:6], [1.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    planner.sift()
    assert planner.next_batch() is None  # one informative group of the two a step needs
    _score(planner, out[6:], [0.0, 1.0])
    planner.sift()
    batch = planner.next_batch()
    assert batch is not None and len(batch) == 2
    assert planner.closed.zero_variance_groups == 2 and planner.closed.groups == 4


def test_past_the_generation_bound_a_short_batch_goes_ahead(ledger, job):
    planner = Planner(job_config(), job, ledger)
    planner.cfg.algo.max_generation_per_step = 3
    out = planner.plan(step=0, training=False)
    _score(planner, out[:6], [1.0, 0.0, 1.0, 1.0, 0.0, 0.0])
    planner.sift()
    batch = planner.next_batch()
    assert batch is not None and len(batch) == 1  # 3 groups judged, 1 informative


def test_with_nothing_informative_past_the_bound_the_job_ends_failed_or_solved(ledger, job):
    from rlsys.control.job_end import JobEnd

    planner = Planner(job_config(), job, ledger)
    planner.cfg.algo.max_generation_per_step = 2
    out = planner.plan(step=0, training=False)
    _score(planner, out[:4], [0.0] * 4)
    planner.sift()
    with pytest.raises(JobEnd) as end:
        planner.next_batch()
    assert end.value.status == "failed" and "no learning signal" in end.value.reason
    assert "out of this policy's reach" in end.value.reason

    solved = Planner(job_config(), job, ledger)
    solved.cfg.algo.max_generation_per_step = 2
    solved.cfg.rollout.curriculum.solved_window = 4
    out = solved.plan(step=0, training=False)
    _score(solved, out[:4], [1.0] * 4)
    solved.sift()
    with pytest.raises(JobEnd) as end:
        solved.next_batch()
    assert end.value.status == "completed" and end.value.reason.startswith("solved")
