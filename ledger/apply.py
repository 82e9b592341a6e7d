"""Applying a batch of transitions and events inside one write transaction.

Order of work, and why:
1. on a retry, drop the records an earlier attempt already committed (ids are client-made);
2. read the current state of every touched rollout, locked (`FOR UPDATE` on PostgreSQL;
   SQLite already holds the write lock from `BEGIN IMMEDIATE`), in id order so two batches
   never deadlock;
3. walk the transitions in order through the state machine, in memory, so one batch may
   carry several steps of the same rollout (plan -> admit -> run);
4. write history rows, the new current state and the events with executemany.
A refused transition raises `TransitionConflict` before anything is written (or, with
`on_conflict="skip"`, is reported back while the rest commits). The database backs this
up: `(rollout_id, seq)` is unique, one terminal row per rollout, and a trigger refuses to
move a rollout out of a terminal state.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from sqlalchemy import Connection, select
from sqlalchemy.exc import IntegrityError

from rlsys.ledger.bulk import bulk_insert, bulk_update, coalesce_new
from rlsys.ledger.errors import TransitionConflict, UnknownRollout
from rlsys.ledger.models import Rollout, RolloutEvent, RolloutTransition
from rlsys.ledger.records import UPDATABLE_COLUMNS, Event, Transition
from rlsys.types import is_terminal, transition_allowed

OnConflict = Literal["raise", "skip"]
_IN_CHUNK = 900  # stay below SQLite's bound-parameter limits on old builds

_rollouts = Rollout.__table__
_history = RolloutTransition.__table__
_events = RolloutEvent.__table__


@dataclass
class ApplyResult:
    """What a batch did: counts written and the transitions refused (with `skip`)."""

    transitions_written: int = 0
    events_written: int = 0
    conflicts: list[str] = field(default_factory=list)
    skipped_as_duplicate: int = 0


def _existing_ids(conn: Connection, column: Any, ids: list[str]) -> set[str]:
    found: set[str] = set()
    for i in range(0, len(ids), _IN_CHUNK):
        found.update(
            conn.execute(select(column).where(column.in_(ids[i : i + _IN_CHUNK]))).scalars()
        )
    return found


def _lock_current(conn: Connection, ids: list[str]) -> dict[str, tuple[str, int]]:
    current: dict[str, tuple[str, int]] = {}
    for i in range(0, len(ids), _IN_CHUNK):
        query = (
            select(_rollouts.c.id, _rollouts.c.state, _rollouts.c.state_seq)
            .where(_rollouts.c.id.in_(ids[i : i + _IN_CHUNK]))
            .order_by(_rollouts.c.id)
        )
        if conn.dialect.name == "postgresql":
            query = query.with_for_update()
        for rid, state, seq in conn.execute(query):
            current[rid] = (state, seq)
    return current


def _refusal(t: Transition, state: str) -> str | None:
    if t.expected_from is not None and state != t.expected_from:
        return (
            f"rollout {t.rollout_id} is {state}, not {t.expected_from}; cannot move to {t.to_state}"
        )
    if is_terminal(state):
        return f"rollout {t.rollout_id} already ended as {state}; cannot move to {t.to_state}"
    if not transition_allowed(state, t.to_state):
        return f"rollout {t.rollout_id}: {state} -> {t.to_state} is not a valid transition"
    return None


def apply_batch(
    conn: Connection,
    transitions: Sequence[Transition],
    events: Sequence[Event],
    *,
    on_conflict: OnConflict,
    retrying: bool,
) -> ApplyResult:
    """Apply `transitions` then `events` in the caller's transaction (see module doc)."""
    result = ApplyResult()
    if retrying:
        done = _existing_ids(conn, _history.c.transition_id, [t.id for t in transitions])
        seen = _existing_ids(conn, _events.c.id, [e.id for e in events])
        result.skipped_as_duplicate = len(done) + len(seen)
        transitions = [t for t in transitions if t.id not in done]
        events = [e for e in events if e.id not in seen]

    ids = sorted({t.rollout_id for t in transitions})
    current = _lock_current(conn, ids)
    missing = [rid for rid in ids if rid not in current]
    if missing:
        raise UnknownRollout(
            f"unknown rollout id {missing[0]}"
            + (f" (+{len(missing) - 1})" if len(missing) > 1 else "")
        )

    history_rows, finals = [], {}
    for t in transitions:
        state, seq = current[t.rollout_id]
        refusal = _refusal(t, state)
        if refusal:
            result.conflicts.append(refusal)
            continue
        terminal = is_terminal(t.to_state)
        history_rows.append(
            {
                "transition_id": t.id,
                "rollout_id": t.rollout_id,
                "seq": seq + 1,
                "from_state": state,
                "to_state": t.to_state.value,
                "is_terminal": terminal,
                "at": t.at,
                "reason": t.reason,
            }
        )
        current[t.rollout_id] = (t.to_state.value, seq + 1)
        final = finals.setdefault(
            t.rollout_id, {"prev_seq": seq, **dict.fromkeys(UPDATABLE_COLUMNS)}
        )
        final.update(t.updates or {})
        final.update(
            state=t.to_state.value, seq=seq + 1, at=t.at, reason=t.reason or final.get("reason")
        )
        final["ended_at"] = t.at if terminal else None

    if result.conflicts and on_conflict == "raise":
        raise TransitionConflict(result.conflicts)
    try:
        _write(conn, history_rows, finals, events)
    except IntegrityError as err:
        # The database's own guard fired: another writer got there between our read and
        # write (only possible if a caller bypassed the locking read).
        raise TransitionConflict([f"database refused the batch: {err.orig}"]) from err
    result.transitions_written = len(history_rows)
    result.events_written = len(events)
    return result


def _write(
    conn: Connection,
    history_rows: list[dict[str, Any]],
    finals: dict[str, dict[str, Any]],
    events: Sequence[Event],
) -> None:
    bulk_insert(conn, _history, history_rows)
    if finals:
        assign: dict[str, Any] = {
            "state": "state",
            "state_seq": "seq",
            "updated_at": "at",
            "ended_at": coalesce_new("ended_at"),
            "reason": coalesce_new("reason"),
            **{col: coalesce_new(f"u_{col}") for col in UPDATABLE_COLUMNS},
        }
        rows = [
            {
                "rid": rid,
                "prev_seq": f["prev_seq"],
                "state": f["state"],
                "seq": f["seq"],
                "at": f["at"],
                "ended_at": f["ended_at"],
                "reason": f["reason"],
                **{f"u_{col}": f[col] for col in UPDATABLE_COLUMNS},
            }
            for rid, f in finals.items()
        ]
        matched = bulk_update(
            conn, _rollouts, rows, match={"id": "rid", "state_seq": "prev_seq"}, assign=assign
        )
        if matched not in (len(rows), -1) and conn.dialect.supports_sane_multi_rowcount:
            raise TransitionConflict(["a rollout changed under the batch; re-read and retry"])
    bulk_insert(
        conn,
        _events,
        [
            {
                "id": e.id,
                "rollout_id": e.rollout_id,
                "job_id": e.job_id,
                "kind": e.kind,
                "turn": e.turn,
                "at": e.at,
                "tokens": e.tokens,
                "data": e.data,
            }
            for e in events
        ],
    )
