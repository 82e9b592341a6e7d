"""Planning and the staleness gate (`Planner`), against a real SQLite ledger."""

import pytest

from rlsys.actors.planner import Planner
from tests.actors.conftest import job_config

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
