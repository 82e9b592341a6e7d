"""Group commit (`GroupCommitWriter`) on a real SQLite ledger: concurrent rollouts' writes
share transactions, each caller returns once its records are committed, and a refused
transition fails only its own caller."""

import threading

import pytest

from rlsys.control.ledger_writer import GroupCommitWriter
from rlsys.control.planner import Planner
from rlsys.ledger.errors import TransitionConflict
from rlsys.ledger.reconcile import finish_job
from rlsys.ledger.records import Event, Transition
from rlsys.types import RolloutState as S
from tests.control.conftest import job_config

pytestmark = pytest.mark.unit


class HeldFirstCommit:
    """The real ledger, whose first commit waits until every rollout has queued its write:
    what a slow commit does under load, made deterministic."""

    def __init__(self, ledger) -> None:  # type: ignore[no-untyped-def]
        self.ledger, self.release, self.calls = ledger, threading.Event(), 0
        self.first_rollouts = 0  # rollouts the held commit carries

    def apply(self, transitions, events=()):  # type: ignore[no-untyped-def]
        self.calls += 1
        if self.calls == 1:
            self.first_rollouts = len({t.rollout_id for t in transitions})
            assert self.release.wait(60)
        return self.ledger.apply(transitions, events)


def test_concurrent_rollouts_commit_together_and_each_caller_sees_its_commit(ledger, job):
    ids = [a.rollout_id for a in Planner(job_config(), job, ledger).plan(step=0, training=False)]
    held = HeldFirstCommit(ledger)
    writer = GroupCommitWriter(held)  # type: ignore[arg-type]

    def rollout(rid: str) -> None:
        writer.apply([Transition(rid, S.ADMITTED), Transition(rid, S.RUNNING)])
        assert ledger.rollout_state(rid) == "running"  # committed before apply returned
        writer.apply([Transition(rid, S.SCORED)], [Event(rid, job, "turn", turn=0)])

    threads = [threading.Thread(target=rollout, args=(r,)) for r in ids]
    for t in threads:
        t.start()
    for _ in range(6000):  # until every rollout's start is held or queued (at most 60 s)
        if held.first_rollouts and held.first_rollouts + writer._queue.qsize() == len(ids):
            break
        threading.Event().wait(0.01)
    held.release.set()
    for t in threads:
        t.join()
    writer.close()
    assert {ledger.rollout_state(r) for r in ids} == {"scored"}
    # The held commit, then every other start in one, then the ends: far fewer than
    # one transaction per write (16 here).
    assert writer.batches <= 2 + len(ids)


def test_a_refused_transition_fails_only_its_caller(ledger, job):
    a, b = [x.rollout_id for x in Planner(job_config(), job, ledger).plan(step=0, training=False)][
        :2
    ]
    ledger.apply([Transition(a, S.CANCELLED)])  # a stop ended it: `admitted` is refused
    writer = GroupCommitWriter(ledger)
    errors = []
    gate = threading.Barrier(2)

    def write(rid: str) -> None:
        gate.wait()
        try:
            writer.apply([Transition(rid, S.ADMITTED)])
        except TransitionConflict as err:
            errors.append((rid, err))

    threads = [threading.Thread(target=write, args=(r,)) for r in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    writer.close()
    assert [rid for rid, _ in errors] == [a]
    assert ledger.rollout_state(b) == "admitted"


def test_a_rollout_the_job_end_cancelled_is_reported_as_ended_not_raised(ledger, job):
    # The race the job's end runs against a worker: `finish_job` cancels a dispatched
    # rollout, then the worker writes its start (or, for one already running, its end).
    planned = [
        a.rollout_id for a in Planner(job_config(), job, ledger).plan(step=0, training=False)
    ]
    started, waiting, live = planned[:3]
    writer = GroupCommitWriter(ledger)
    admit = [Transition(started, S.ADMITTED), Transition(started, S.RUNNING)]
    assert writer.apply_unless_ended(started, admit) is None
    # A refusal of a live rollout is still the caller's error (planned -> scored is invalid).
    with pytest.raises(TransitionConflict):
        writer.apply_unless_ended(live, [Transition(live, S.SCORED)])
    finish_job(ledger, job, "failed", "no learning signal: test")
    assert writer.apply_unless_ended(waiting, [Transition(waiting, S.ADMITTED)]) == "cancelled"
    end = [Transition(started, S.SCORED)]
    assert writer.apply_unless_ended(started, end, [Event(started, job, "turn")]) == "cancelled"
    writer.close()
    assert {ledger.rollout_state(r) for r in planned} == {"cancelled"}
