"""Committing a step (`StepCommitter`) and agreeing with a restored checkpoint."""

import pytest

from rlsys.control.messages import Filtered, StepReport, StreamPosition, TrainerPosition
from rlsys.control.planner import Planner
from rlsys.control.step_commit import StepCommitter
from rlsys.ledger.records import Transition
from rlsys.types import RolloutState as S
from tests.control.conftest import job_config

pytestmark = pytest.mark.unit


def _scored(ledger, job, n=4):
    out = Planner(job_config(), job, ledger).plan(step=0, training=False)[:n]
    ids = [a.rollout_id for a in out]
    ledger.apply([Transition(r, s) for r in ids for s in (S.ADMITTED, S.RUNNING, S.SCORED)])
    return ids


def test_a_committed_step_ends_each_rollout_trained_or_as_filtered(ledger, job):
    ids = _scored(ledger, job)
    committer = StepCommitter(ledger, job)
    committer.buffer(ids)
    committer.buffer(ids)  # a redone step: no second `buffered` transition
    stale = Filtered(ids[0], "filtered_stale", "3 versions old")
    assert committer.commit(ids, [stale], version=1) == 1
    assert [ledger.rollout_state(r) for r in ids] == ["filtered_stale"] + ["trained"] * 3


def test_a_checkpoint_ahead_of_the_ledger_is_recovered_without_training_again(ledger, job):
    ids = _scored(ledger, job)
    committer = StepCommitter(ledger, job)
    committer.buffer(ids[:2])
    report = StepReport(True, 1, {}, [], entries=["0-1", "0-2"])
    position = committer.checkpoint_position(1, 1, ids[:2], report)
    # The trainer died after checkpointing, before the ledger commit: a new controller
    # (or the replaced trainer) reads the checkpoint's record back.
    stored = StreamPosition.from_record(position.as_record())
    assert stored == position and stored.consumed_entries == ["0-1", "0-2"]
    start = TrainerPosition(1, 1, checkpoint=stored)
    assert StepCommitter(ledger, job).recover(start) == ids[:2]
    assert [ledger.rollout_state(r) for r in ids] == ["trained", "trained", "scored", "scored"]
    assert StepCommitter(ledger, job).recover(start) == []  # idempotent


def test_recover_of_a_fresh_trainer_touches_nothing(ledger, job):
    ids = _scored(ledger, job)
    assert StepCommitter(ledger, job).recover(TrainerPosition(0, 0)) == []
    assert {ledger.rollout_state(r) for r in ids} == {"scored"}
