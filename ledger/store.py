"""The `Ledger`: the writer's and the reader's handle on one ledger database.

Invariants:
- a rollout exists in the ledger (as `planned`) before anything is dispatched for it;
- every write is one transaction, retried whole through transient failures, idempotent
  on retry (client ids);
- after `finish_job`, no rollout of that job is without a terminal state (`lost` = 0).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import Connection, Engine, event, insert, inspect, select, update

from rlsys.ledger import migrate
from rlsys.ledger.apply import ApplyResult, OnConflict, apply_batch
from rlsys.ledger.bulk import bulk_insert
from rlsys.ledger.db import create_ledger_engine, resolve_url
from rlsys.ledger.errors import UnknownJob
from rlsys.ledger.models import Job, Owner, Rollout, RolloutTransition, TrainerStep
from rlsys.ledger.records import Event, PlannedRollout, Transition, new_id
from rlsys.ledger.retry import RetryPolicy, run_write
from rlsys.types import RolloutState

JOB_RUNNING = "running"
JOB_STOPPING = "stopping"  # asked to stop through the ledger; its driver sees it within a second
JOB_LIVE_STATUSES = (JOB_RUNNING, JOB_STOPPING)
JOB_END_STATUSES = ("completed", "stopped", "failed")


class Ledger:
    """A handle on one ledger database (thread-safe: each write uses its own connection)."""

    def __init__(self, engine: Engine, retry: RetryPolicy | None = None) -> None:
        self.engine = engine
        self.retry = retry or RetryPolicy()
        # Connections found dead and replaced (the database restarted under us): what a
        # fault test reads to know the restart was seen, and what an operator may count.
        self.reconnects = 0
        event.listen(engine.pool, "invalidate", self._count_reconnect)

    def _count_reconnect(self, *_args: Any) -> None:
        self.reconnects += 1

    @classmethod
    def open(cls, url: str | None = None, *, create: bool = True, **kw: Any) -> Ledger:
        """Open the ledger at `url` (resolved as docs/ARCHITECTURE.md, "The ledger", says).

        `create=True` creates the database file and migrates the schema to head;
        `create=False` (readers) creates nothing and accepts a database with no ledger yet,
        but brings a ledger an older release wrote up to this code's schema (every report
        reads the newer columns).
        """
        engine = create_ledger_engine(resolve_url(url), must_exist=not create)
        if create:
            migrate.upgrade(engine)
        elif migrate.current_revision(engine) not in (None, migrate.head_revision()):
            migrate.upgrade(engine)
        return cls(engine, **kw)

    def close(self) -> None:
        self.engine.dispose()

    def has_schema(self) -> bool:
        """Whether this database holds a ledger (false on a fresh database)."""
        return inspect(self.engine).has_table("rollouts")

    # -- jobs -------------------------------------------------------------------------
    def create_job(self, name: str, config: dict[str, Any], job_id: str | None = None) -> str:
        job_id = job_id or new_id("j")

        def work(conn: Connection, retrying: bool) -> None:
            exists = conn.execute(select(Job.id).where(Job.id == job_id)).first()
            if exists and retrying:
                return
            now = time.time()
            conn.execute(
                insert(Job).values(
                    id=job_id,
                    name=name,
                    config=config,
                    status=JOB_RUNNING,
                    created_at=now,
                    heartbeat_at=now,
                )
            )

        run_write(self.engine, work, self.retry)
        return job_id

    def get_job(self, job_id: str) -> dict[str, Any]:
        with self.engine.connect() as conn:
            row = conn.execute(select(Job.__table__).where(Job.id == job_id)).mappings().first()
        if row is None:
            raise UnknownJob(f"unknown job {job_id!r} in this ledger")
        return dict(row)

    def latest_job_id(self) -> str | None:
        with self.engine.connect() as conn:
            return conn.execute(
                select(Job.id).order_by(Job.created_at.desc()).limit(1)
            ).scalar_one_or_none()

    def set_job_status(self, job_id: str, status: str) -> None:
        def work(conn: Connection, _retrying: bool) -> None:
            now = time.time()
            values: dict[str, Any] = {"status": status}
            if status in JOB_END_STATUSES:
                values["ended_at"] = now
            elif status == JOB_RUNNING:  # (re)started: a driver owns it and beats from now on
                values.update(ended_at=None, end_reason=None, heartbeat_at=now)
            conn.execute(update(Job).where(Job.id == job_id).values(**values))

        run_write(self.engine, work, self.retry)

    def job_heartbeat(self, job_id: str) -> None:
        """The driver is alive: renew the job's heartbeat (a lapsed one reads `orphaned`)."""
        run_write(
            self.engine,
            lambda conn, _r: conn.execute(
                update(Job)
                .where(Job.id == job_id, Job.status.in_(JOB_LIVE_STATUSES))
                .values(heartbeat_at=time.time())
            ),
            self.retry,
        )

    # -- rollouts ---------------------------------------------------------------------
    def plan(self, job_id: str, rollouts: Sequence[PlannedRollout]) -> list[str]:
        """Write `rollouts` as `planned` (the 'expected' set); returns their ids."""

        def work(conn: Connection, retrying: bool) -> None:
            todo = list(rollouts)
            if retrying:
                have = set(
                    conn.execute(
                        select(Rollout.id).where(Rollout.id.in_([r.id for r in todo]))
                    ).scalars()
                )
                todo = [r for r in todo if r.id not in have]
            if todo:
                insert_planned(conn, job_id, todo, time.time())

        run_write(self.engine, work, self.retry)
        return [r.id for r in rollouts]

    def apply(
        self,
        transitions: Sequence[Transition] = (),
        events: Sequence[Event] = (),
        *,
        on_conflict: OnConflict = "raise",
    ) -> ApplyResult:
        """Apply a batch of transitions and events atomically (see `rlsys.ledger.apply`)."""
        return run_write(
            self.engine,
            lambda conn, retrying: apply_batch(
                conn, transitions, events, on_conflict=on_conflict, retrying=retrying
            ),
            self.retry,
        )

    def transition(
        self,
        rollout_id: str,
        to_state: RolloutState | str,
        reason: str | None = None,
        **updates: Any,
    ) -> None:
        """Move one rollout; raises `TransitionConflict` if the state machine refuses."""
        self.apply(
            [Transition(rollout_id, RolloutState(to_state), reason, updates=updates or None)]
        )

    def record_events(self, events: Iterable[Event]) -> None:
        self.apply((), list(events))

    def rollout_state(self, rollout_id: str) -> str | None:
        with self.engine.connect() as conn:
            return conn.execute(
                select(Rollout.state).where(Rollout.id == rollout_id)
            ).scalar_one_or_none()

    def rollout_reason(self, rollout_id: str) -> str | None:
        with self.engine.connect() as conn:
            return conn.execute(
                select(Rollout.reason).where(Rollout.id == rollout_id)
            ).scalar_one_or_none()

    # -- leases -----------------------------------------------------------------------
    def heartbeat(self, owner: str, job_id: str, lease_s: float) -> None:
        """Renew `owner`'s lease: its rollouts stay live while it keeps doing this."""

        def work(conn: Connection, _retrying: bool) -> None:
            now = time.time()
            res = conn.execute(
                update(Owner)
                .where(Owner.id == owner)
                .values(heartbeat_at=now, expires_at=now + lease_s)
            )
            if res.rowcount == 0:
                conn.execute(
                    insert(Owner).values(
                        id=owner, job_id=job_id, heartbeat_at=now, expires_at=now + lease_s
                    )
                )

        run_write(self.engine, work, self.retry)

    def release(self, owner: str) -> None:
        """End `owner`'s lease now (a clean shutdown); its live rollouts become reclaimable."""
        run_write(
            self.engine,
            lambda conn, _r: conn.execute(
                update(Owner).where(Owner.id == owner).values(expires_at=0.0)
            ),
            self.retry,
        )

    # -- trainer steps ----------------------------------------------------------------
    def record_trainer_step(
        self, job_id: str, step: int, policy_version: int, metrics: dict[str, Any]
    ) -> None:
        # Idempotent: a replaced trainer's recovery may record a step the crash left out.
        def work(conn: Connection, _retrying: bool) -> None:
            if conn.execute(
                select(TrainerStep.id).where(TrainerStep.job_id == job_id, TrainerStep.step == step)
            ).first():
                return
            conn.execute(
                insert(TrainerStep).values(
                    job_id=job_id,
                    step=step,
                    policy_version=policy_version,
                    at=time.time(),
                    metrics=metrics,
                )
            )

        run_write(self.engine, work, self.retry)


def insert_planned(
    conn: Connection, job_id: str, rollouts: Sequence[PlannedRollout], now: float
) -> None:
    """Insert `planned` rows and their first history entry (seq 0) in `conn`'s transaction."""
    bulk_insert(
        conn,
        Rollout.__table__,
        [
            {
                "id": r.id,
                "job_id": job_id,
                "group_id": r.group_id,
                "task_id": r.task_id,
                "session_id": r.session_id,
                "attempt": r.attempt,
                "retry_of": r.retry_of,
                "state": RolloutState.PLANNED.value,
                "state_seq": 0,
                "prompt_tokens": 0,
                "completion_tokens": 0,
                "turns": 0,
                "created_at": now,
                "updated_at": now,
            }
            for r in rollouts
        ],
    )
    bulk_insert(
        conn,
        RolloutTransition.__table__,
        [
            {
                "transition_id": new_id("t"),
                "rollout_id": r.id,
                "seq": 0,
                "from_state": None,
                "to_state": RolloutState.PLANNED.value,
                "is_terminal": False,
                "at": now,
                "reason": f"retry of {r.retry_of}" if r.retry_of else None,
            }
            for r in rollouts
        ],
    )
