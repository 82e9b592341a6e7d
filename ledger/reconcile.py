"""Reconciliation: naming a terminal state for every rollout nobody will finish.

Three rules, each one transaction:
- `reconcile_leases`: a live rollout whose owner stopped renewing its lease (or never had
  one on record) is ended as `failed_worker_lost`; optionally a retry row is planned,
  linked both ways (`retry_of` on the new row, events on both).
- `reconcile_rollouts`: the same for named rollouts the caller knows failed (a task error
  inside a live worker), ending each still-live one in the state given.
- `finish_job`: when a job ends, every rollout still live is named: `cancelled` when the job
  was stopped, `failed_worker_lost` when its owner's lease has lapsed, `cancelled` with a
  reason otherwise. After it, `lost` is 0 for that job. One exception: a *stopped* job
  keeps its `scored`/`buffered` rollouts live ("parked"): their trajectories wait in the
  durable stream, and a resume trains them (`queries.stats` counts them as `parked`).
- `reap_job`: a job whose driver died (`liveness.is_orphaned`) is ended by hand: every
  live rollout `failed_driver_lost`, the job `failed` with the reason.

Retries count along the chain: a retry of attempt n is attempt n + 1, planned only while
n + 1 < `max_attempts`, so a retry of a retry uses up the budget like the first.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from sqlalchemy import Connection, select, update

from rlsys.ledger.apply import apply_batch
from rlsys.ledger.liveness import JobNotOrphaned, driver_timeout_s, heartbeat_age_s, is_orphaned
from rlsys.ledger.models import Job, Owner, Rollout
from rlsys.ledger.records import Event, PlannedRollout, Transition, new_id
from rlsys.ledger.retry import run_write
from rlsys.ledger.store import JOB_END_STATUSES, Ledger, insert_planned
from rlsys.types import NON_TERMINAL_STATES, RolloutState

_LIVE = sorted(s.value for s in NON_TERMINAL_STATES)
# A worker owns a rollout while it runs it; once scored, the rollout is in the stream and
# the trainer's hands, so its worker's death cannot lose it.
_OWNED_BY_WORKER = sorted(s.value for s in (RolloutState.ADMITTED, RolloutState.RUNNING))
PARKED_STATES = (RolloutState.SCORED, RolloutState.BUFFERED)
_PARKED = {s.value for s in PARKED_STATES}


@dataclass
class ReconcileResult:
    """Rollouts ended as lost, and the retry rows planned for them (old id -> new id)."""

    lost: list[str] = field(default_factory=list)
    retries: dict[str, str] = field(default_factory=dict)


def _expired_owner_rows(conn: Connection, job_id: str, now: float) -> list[tuple]:
    live_owner = select(Owner.id).where(Owner.expires_at >= now)
    query = (
        select(Rollout.id, Rollout.owner, Rollout.group_id, Rollout.task_id, Rollout.attempt)
        .where(
            Rollout.job_id == job_id,
            Rollout.state.in_(_OWNED_BY_WORKER),
            Rollout.owner.is_not(None),
            Rollout.owner.not_in(live_owner),
        )
        .order_by(Rollout.id)
    )
    return list(conn.execute(query))


def _end_and_retry(
    conn: Connection,
    job_id: str,
    rows: list[tuple],
    state: RolloutState,
    reason: Callable[[str | None], str],
    retry: bool,
    max_attempts: int,
) -> ReconcileResult:
    """End `rows` (id, owner, group_id, task_id, attempt) in `state`; plan linked retries."""
    now = time.time()
    result = ReconcileResult()
    transitions, events, retries = [], [], []
    for rid, owner, group_id, task_id, attempt in rows:
        transitions.append(Transition(rid, state, reason=reason(owner)))
        result.lost.append(rid)
        if retry and attempt + 1 < max_attempts:
            new = PlannedRollout(group_id, task_id, attempt=attempt + 1, retry_of=rid)
            retries.append(new)
            result.retries[rid] = new.id
            events.append(Event(rid, job_id, "retried_as", data={"rollout_id": new.id}))
            events.append(Event(new.id, job_id, "retry_of", data={"rollout_id": rid}))
    if retries:
        insert_planned(conn, job_id, retries, now)
    apply_batch(conn, transitions, events, on_conflict="raise", retrying=False)
    return result


def reconcile_leases(
    ledger: Ledger, job_id: str, *, retry: bool = False, max_attempts: int = 2
) -> ReconcileResult:
    """End rollouts of lapsed owners as `failed_worker_lost`; plan linked retries if asked."""

    def work(conn: Connection, _retrying: bool) -> ReconcileResult:
        rows = _expired_owner_rows(conn, job_id, time.time())
        return _end_and_retry(
            conn,
            job_id,
            rows,
            RolloutState.FAILED_WORKER_LOST,
            lambda owner: f"owner {owner} stopped renewing its lease",
            retry,
            max_attempts,
        )

    return run_write(ledger.engine, work, ledger.retry)


def reconcile_rollouts(
    ledger: Ledger,
    job_id: str,
    rollout_ids: Sequence[str],
    state: RolloutState,
    reason: str,
    *,
    retry: bool = False,
    max_attempts: int = 2,
) -> ReconcileResult:
    """End those of `rollout_ids` still owned by a worker (admitted/running) in `state`,
    with linked retries if asked; rollouts in any other state are left alone."""

    def work(conn: Connection, _retrying: bool) -> ReconcileResult:
        query = (
            select(Rollout.id, Rollout.owner, Rollout.group_id, Rollout.task_id, Rollout.attempt)
            .where(
                Rollout.job_id == job_id,
                Rollout.id.in_(list(rollout_ids)),
                Rollout.state.in_(_OWNED_BY_WORKER + [RolloutState.PLANNED.value]),
            )
            .order_by(Rollout.id)
        )
        rows = list(conn.execute(query))
        return _end_and_retry(conn, job_id, rows, state, lambda _owner: reason, retry, max_attempts)

    return run_write(ledger.engine, work, ledger.retry)


def retry_ended(
    ledger: Ledger, job_id: str, rollout_ids: Sequence[str], *, max_attempts: int
) -> dict[str, str]:
    """Plan a linked retry for each of `rollout_ids` that already ended (in a failed state
    its worker named, e.g. `failed_stream`) and has attempts left; returns old -> new id.
    Idempotent: a rollout that already has a retry gets no second one."""

    def work(conn: Connection, _retrying: bool) -> dict[str, str]:
        rows = conn.execute(
            select(Rollout.id, Rollout.group_id, Rollout.task_id, Rollout.attempt)
            .where(Rollout.job_id == job_id, Rollout.id.in_(list(rollout_ids)))
            .order_by(Rollout.id)
        ).all()
        have = set(
            conn.execute(
                select(Rollout.retry_of).where(Rollout.retry_of.in_([r[0] for r in rows]))
            ).scalars()
        )
        retries, events, out = [], [], {}
        for rid, group_id, task_id, attempt in rows:
            if rid in have or attempt + 1 >= max_attempts:
                continue
            new = PlannedRollout(group_id, task_id, attempt=attempt + 1, retry_of=rid)
            retries.append(new)
            out[rid] = new.id
            events.append(Event(rid, job_id, "retried_as", data={"rollout_id": new.id}))
            events.append(Event(new.id, job_id, "retry_of", data={"rollout_id": rid}))
        if retries:
            insert_planned(conn, job_id, retries, time.time())
        apply_batch(conn, (), events, on_conflict="raise", retrying=False)
        return out

    return run_write(ledger.engine, work, ledger.retry)


def finish_job(
    ledger: Ledger,
    job_id: str,
    status: str,
    reason: str | None = None,
    *,
    driver_lost: bool = False,
) -> int:
    """Mark the job ended (with `reason`) and name a terminal state for every live rollout;
    returns how many rollouts it ended.

    Safe against writers that end rollouts while it runs (workers finishing after a
    cancel, a trainer committing): the live rows are read locked (`FOR UPDATE` on
    PostgreSQL, in id order like every writer; SQLite's `BEGIN IMMEDIATE` holds the write
    lock), so the states it decides from are the states it writes over. `driver_lost`
    (a reaped job) ends every live rollout, parked ones too, `failed_driver_lost`.
    """
    if status not in JOB_END_STATUSES:
        raise ValueError(f"job end status must be one of {JOB_END_STATUSES}, got {status!r}")

    def work(conn: Connection, _retrying: bool) -> int:
        now = time.time()
        lapsed = set(r[0] for r in _expired_owner_rows(conn, job_id, now))
        query = (
            select(Rollout.id, Rollout.state)
            .where(Rollout.job_id == job_id, Rollout.state.in_(_LIVE))
            .order_by(Rollout.id)
        )
        if conn.dialect.name == "postgresql":
            query = query.with_for_update()
        transitions = []
        for rid, state in conn.execute(query).all():
            to, why = _end_of_live(status, state, rid in lapsed, driver_lost, reason)
            if to is not None:
                transitions.append(Transition(rid, to, reason=why, id=new_id("t")))
        apply_batch(conn, transitions, (), on_conflict="raise", retrying=False)
        conn.execute(
            update(Job)
            .where(Job.id == job_id)
            .values(status=status, ended_at=now, end_reason=reason)
        )
        return len(transitions)

    return run_write(ledger.engine, work, ledger.retry)


def _end_of_live(
    status: str, state: str, lapsed: bool, driver_lost: bool, reason: str | None
) -> tuple[RolloutState | None, str]:
    """The terminal state a rollout still live at the job's end gets (None: parked)."""
    if driver_lost:
        return RolloutState.FAILED_DRIVER_LOST, f"the job's driver was lost while {state}"
    if status == "stopped" and state in _PARKED:
        return None, ""  # its trajectory waits in the stream; a resume trains it
    if status == "stopped":
        return RolloutState.CANCELLED, f"job stopped while {state}"
    if lapsed:
        return RolloutState.FAILED_WORKER_LOST, "owner lease lapsed before the job ended"
    why = f"job ended ({status}{': ' + reason if reason else ''}) while {state}"
    return RolloutState.CANCELLED, why[:500]


def reap_job(ledger: Ledger, job_id: str, now: float | None = None) -> int:
    """End an orphaned job (its driver stopped beating): every live rollout
    `failed_driver_lost`, the job `failed`; returns how many rollouts it ended. Refuses a
    job whose driver is alive or that already ended (`JobNotOrphaned`)."""
    job = ledger.get_job(job_id)
    if not is_orphaned(job, now):
        age = heartbeat_age_s(job, now)
        if job["status"] in JOB_END_STATUSES:
            raise JobNotOrphaned(f"job {job_id} already ended ({job['status']}): nothing to reap")
        raise JobNotOrphaned(
            f"job {job_id} is {job['status']} and its driver beat {age:.0f} s ago "
            f"(orphaned after {driver_timeout_s(job):.0f} s): stop it with `rlsys jobs stop`"
        )
    reason = f"driver lost: no heartbeat for {heartbeat_age_s(job, now):.0f} s; reaped"
    return finish_job(ledger, job_id, "failed", reason, driver_lost=True)
