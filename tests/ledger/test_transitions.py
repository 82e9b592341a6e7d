"""Transitions on both backends: the state machine, batching, and the database's own guards."""

import pytest
import sqlalchemy as sa

from rlsys.ledger.errors import TransitionConflict, UnknownRollout
from rlsys.ledger.records import Event, Transition
from rlsys.types import RolloutState as S
from tests.ledger.helpers import advance, planned_job

pytestmark = pytest.mark.services


def history(ledger, rid):
    with ledger.engine.connect() as conn:
        return [
            tuple(r)
            for r in conn.execute(
                sa.text(
                    "SELECT seq, from_state, to_state FROM rollout_transitions "
                    "WHERE rollout_id = :r ORDER BY seq"
                ),
                {"r": rid},
            )
        ]


def test_full_lifecycle_records_every_step_in_order(ledger):
    _, (rid,) = planned_job(ledger, 1)
    advance(ledger, [rid])
    ledger.transition(rid, S.TRAINED, trained_version=3)
    assert [h[2] for h in history(ledger, rid)] == [
        "planned",
        "admitted",
        "running",
        "scored",
        "buffered",
        "trained",
    ]
    assert ledger.rollout_state(rid) == "trained"


def test_second_terminal_transition_is_a_conflict(ledger):
    _, (rid,) = planned_job(ledger, 1)
    advance(ledger, [rid])
    ledger.transition(rid, S.TRAINED)
    with pytest.raises(TransitionConflict, match="already ended as trained"):
        ledger.transition(rid, S.FAILED_ENGINE)
    assert ledger.rollout_state(rid) == "trained"
    assert len(history(ledger, rid)) == 6


def test_invalid_step_is_refused(ledger):
    _, (rid,) = planned_job(ledger, 1)
    with pytest.raises(TransitionConflict, match="planned -> trained is not a valid"):
        ledger.transition(rid, S.TRAINED)


def test_expected_from_guards_the_step(ledger):
    _, (rid,) = planned_job(ledger, 1)
    with pytest.raises(TransitionConflict, match="is planned, not running"):
        ledger.apply([Transition(rid, S.SCORED, expected_from=S.RUNNING)])


def test_refused_batch_writes_nothing(ledger):
    job, ids = planned_job(ledger, 3)
    batch = [
        Transition(ids[0], S.ADMITTED),
        Transition(ids[1], S.TRAINED),
        Transition(ids[2], S.ADMITTED),
    ]
    with pytest.raises(TransitionConflict):
        ledger.apply(batch, [Event(ids[0], job, "turn", turn=0)])
    assert [ledger.rollout_state(r) for r in ids] == ["planned"] * 3
    with ledger.engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM rollout_events")).scalar() == 0


def test_skip_mode_commits_the_valid_part(ledger):
    _, ids = planned_job(ledger, 2)
    result = ledger.apply(
        [Transition(ids[0], S.ADMITTED), Transition(ids[1], S.TRAINED)], on_conflict="skip"
    )
    assert result.transitions_written == 1 and len(result.conflicts) == 1
    assert ledger.rollout_state(ids[0]) == "admitted"


def test_unknown_rollout_is_named(ledger):
    with pytest.raises(UnknownRollout, match="r-nope"):
        ledger.transition("r-nope", S.ADMITTED)


def test_database_trigger_refuses_leaving_a_terminal_state(ledger):
    _, (rid,) = planned_job(ledger, 1)
    ledger.transition(rid, S.CANCELLED)
    with pytest.raises(sa.exc.DBAPIError, match="terminal state"):
        with ledger.engine.begin() as conn:
            conn.execute(sa.text("UPDATE rollouts SET state = 'running' WHERE id = :r"), {"r": rid})


def test_database_index_refuses_a_second_terminal_history_row(ledger):
    _, (rid,) = planned_job(ledger, 1)
    ledger.transition(rid, S.CANCELLED)
    with pytest.raises(sa.exc.IntegrityError):
        with ledger.engine.begin() as conn:
            conn.execute(
                sa.text(
                    "INSERT INTO rollout_transitions "
                    "(transition_id, rollout_id, seq, from_state, to_state, is_terminal, at) "
                    "VALUES ('t-x', :r, 99, 'running', 'trained', :t, 0)"
                ),
                {"r": rid, "t": True},
            )


def test_retried_batch_is_not_applied_twice(ledger):
    """A batch re-sent after a lost commit acknowledgement skips what already landed."""
    from rlsys.ledger.apply import apply_batch
    from rlsys.ledger.db import WRITE_OPTION

    job, (rid,) = planned_job(ledger, 1)
    batch = [Transition(rid, S.ADMITTED), Transition(rid, S.RUNNING)]
    events = [Event(rid, job, "turn", turn=0, tokens=5)]
    ledger.apply(batch, events)
    with ledger.engine.connect() as conn:
        conn = conn.execution_options(**{WRITE_OPTION: True})
        with conn.begin():
            res = apply_batch(conn, batch, events, on_conflict="raise", retrying=True)
    assert res.skipped_as_duplicate == 3 and res.transitions_written == 0
    assert len(history(ledger, rid)) == 3
