"""SQLAlchemy 2.x models of the lifecycle ledger.

Tables: jobs, rollouts (one row per expected rollout, with a pointer to its current state),
rollout_transitions (append-only state history), rollout_events (append-only turn-level
record) and owners (leases renewed by heartbeats).

Invariants enforced by the database itself, not only by the writer:
- `(rollout_id, seq)` is unique in the history, so two writers that read the same state and
  both try to append the next transition cannot both succeed;
- a partial unique index allows at most one terminal history row per rollout;
- a trigger (created by the migration) rejects any change of `rollouts.state` away from a
  terminal state.
Times are epoch seconds (float): portable across SQLite and PostgreSQL and cheap to write.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    config: Mapped[dict[str, Any]] = mapped_column(JSON)
    status: Mapped[str] = mapped_column(String(32), index=True)
    created_at: Mapped[float] = mapped_column(Float)
    ended_at: Mapped[float | None] = mapped_column(Float)
    # Renewed by the running driver; a running job whose heartbeat lapsed is `orphaned`.
    heartbeat_at: Mapped[float | None] = mapped_column(Float)
    end_reason: Mapped[str | None] = mapped_column(Text)  # why it ended: "solved", an error


class Rollout(Base):
    __tablename__ = "rollouts"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), index=True)
    group_id: Mapped[str] = mapped_column(String(64), index=True)
    task_id: Mapped[str] = mapped_column(String(200))
    session_id: Mapped[str] = mapped_column(String(64))
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    retry_of: Mapped[str | None] = mapped_column(ForeignKey("rollouts.id"), index=True)
    state: Mapped[str] = mapped_column(String(32))
    state_seq: Mapped[int] = mapped_column(Integer, default=0)
    owner: Mapped[str | None] = mapped_column(String(128))
    policy_version_first: Mapped[int | None] = mapped_column(Integer)
    policy_version_last: Mapped[int | None] = mapped_column(Integer)
    trained_version: Mapped[int | None] = mapped_column(Integer)
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0)
    turns: Mapped[int] = mapped_column(Integer, default=0)
    reward: Mapped[float | None] = mapped_column(Float)
    reason: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)
    ended_at: Mapped[float | None] = mapped_column(Float)

    __table_args__ = (Index("ix_rollouts_job_id_state", "job_id", "state"),)


class RolloutTransition(Base):
    __tablename__ = "rollout_transitions"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    transition_id: Mapped[str] = mapped_column(String(64), unique=True)
    rollout_id: Mapped[str] = mapped_column(ForeignKey("rollouts.id"))
    seq: Mapped[int] = mapped_column(Integer)
    from_state: Mapped[str | None] = mapped_column(String(32))
    to_state: Mapped[str] = mapped_column(String(32))
    is_terminal: Mapped[bool] = mapped_column(Boolean)
    at: Mapped[float] = mapped_column(Float)
    reason: Mapped[str | None] = mapped_column(Text)

    __table_args__ = (
        UniqueConstraint("rollout_id", "seq", name="uq_rollout_transitions_rollout_id_seq"),
        Index(
            "uq_rollout_transitions_one_terminal",
            "rollout_id",
            unique=True,
            sqlite_where=text("is_terminal"),
            postgresql_where=text("is_terminal"),
        ),
    )


class RolloutEvent(Base):
    __tablename__ = "rollout_events"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    rollout_id: Mapped[str] = mapped_column(ForeignKey("rollouts.id"), index=True)
    job_id: Mapped[str] = mapped_column(String(64), index=True)
    kind: Mapped[str] = mapped_column(String(32))
    turn: Mapped[int | None] = mapped_column(Integer)
    at: Mapped[float] = mapped_column(Float)
    tokens: Mapped[int | None] = mapped_column(Integer)
    data: Mapped[dict[str, Any] | None] = mapped_column(JSON)


class Owner(Base):
    """A lease holder (a rollout worker): it owns rollouts while it keeps renewing."""

    __tablename__ = "owners"

    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    job_id: Mapped[str] = mapped_column(String(64), index=True)
    heartbeat_at: Mapped[float] = mapped_column(Float)
    expires_at: Mapped[float] = mapped_column(Float)


class TrainerStep(Base):
    """One committed optimiser step and its metrics: what `rlsys monitor` reads."""

    __tablename__ = "trainer_steps"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), index=True)
    step: Mapped[int] = mapped_column(Integer)
    policy_version: Mapped[int] = mapped_column(Integer)
    at: Mapped[float] = mapped_column(Float)
    metrics: Mapped[dict[str, Any]] = mapped_column(JSON)

    __table_args__ = (UniqueConstraint("job_id", "step", name="uq_trainer_steps_job_id_step"),)
