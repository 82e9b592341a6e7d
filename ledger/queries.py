"""Read-only reports over a ledger: stats, drops, one rollout's record.

Definitions (docs/ARCHITECTURE.md, "The ledger"), used by every report:
- expected = rollout rows of the job (each was written as `planned` before dispatch);
- consumed / discarded / dropped = terminal rows by class;
- drop_rate = dropped / expected (0 when nothing is expected);
- lost = rows with no terminal state once the job has ended (while it runs they count as
  `in_flight`, and lost is 0 by definition); a *stopped* job's `scored`/`buffered` rows
  are `parked`, not lost: their trajectories wait in the durable stream for a resume;
  an *orphaned* job (its driver stopped beating: `rlsys.ledger.liveness`) is not running,
  so every live row of it counts as lost until `jobs reap` names their end.
Reports never write, and on a database with no ledger schema they report zeros.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Literal

from sqlalchemy import func, select

from rlsys.ledger.errors import UnknownRollout
from rlsys.ledger.liveness import effective_status, heartbeat_age_s
from rlsys.ledger.models import Rollout, RolloutEvent, RolloutTransition, TrainerStep
from rlsys.ledger.reconcile import PARKED_STATES
from rlsys.ledger.store import JOB_LIVE_STATUSES, Ledger
from rlsys.types import TERMINAL_CLASS, RolloutState, TerminalClass

JOB_STOPPED = "stopped"
DropsBy = Literal["reason", "length", "turns"]
LENGTH_BUCKETS = (0, 256, 1024, 4096, 16384, 65536)
TURN_BUCKETS = (0, 1, 2, 4, 8, 16, 32)


def _resolve_job(ledger: Ledger, job_id: str | None) -> str | None:
    if job_id is not None:
        ledger.get_job(job_id)  # raises UnknownJob
        return job_id
    return ledger.latest_job_id()


def stats(ledger: Ledger, job_id: str | None = None) -> dict[str, Any]:
    """The accounting of one job (the latest when `job_id` is None)."""
    empty: dict[str, Any] = {
        "job_id": None,
        "job_status": None,
        "expected": 0,
        "in_flight": 0,
        "terminal": {s.value: 0 for s in TERMINAL_CLASS},
        "consumed": 0,
        "discarded": 0,
        "dropped": 0,
        "lost": 0,
        "parked": 0,
        "drop_rate": 0.0,
        "retries": 0,
        "end_reason": None,
    }
    if not ledger.has_schema():
        if job_id is not None:
            ledger_job_missing(job_id)
        return empty
    job_id = _resolve_job(ledger, job_id)
    if job_id is None:
        return empty
    job = ledger.get_job(job_id)
    with ledger.engine.connect() as conn:
        counts = dict(
            conn.execute(
                select(Rollout.state, func.count())
                .where(Rollout.job_id == job_id)
                .group_by(Rollout.state)
            ).all()
        )
        retries = conn.execute(
            select(func.count()).where(Rollout.job_id == job_id, Rollout.retry_of.is_not(None))
        ).scalar_one()
    status = effective_status(job)
    out = dict(empty, job_id=job_id, job_status=status, retries=retries)
    out["end_reason"] = job.get("end_reason")
    out["expected"] = sum(counts.values())
    by_class: Counter[str] = Counter()
    for state, cls in TERMINAL_CLASS.items():
        n = counts.get(state.value, 0)
        out["terminal"][state.value] = n
        by_class[cls.value] += n
    live = out["expected"] - sum(by_class.values())
    running = status in JOB_LIVE_STATUSES
    parked = 0
    if status == JOB_STOPPED:
        parked = sum(counts.get(s.value, 0) for s in PARKED_STATES)
    out["in_flight"] = live if running else 0
    out["parked"] = parked
    out["lost"] = 0 if running else live - parked
    for cls in TerminalClass:
        out[cls.value] = by_class[cls.value]
    out["drop_rate"] = out["dropped"] / out["expected"] if out["expected"] else 0.0
    return out


def ledger_job_missing(job_id: str) -> None:
    from rlsys.ledger.errors import UnknownJob

    raise UnknownJob(f"unknown job {job_id!r}: this database holds no rlsys ledger yet")


def _bucket(value: int, edges: tuple[int, ...]) -> str:
    for lo, hi in zip(edges, edges[1:], strict=False):
        if value < hi:
            return f"{lo}-{hi - 1}"
    return f"{edges[-1]}+"


def drops(ledger: Ledger, job_id: str | None = None, by: DropsBy = "reason") -> dict[str, Any]:
    """Dropped rollouts sliced by reason (terminal state), completion length or turns.

    Length and turn slices show expected and dropped per bucket, so a report makes visible
    when drops concentrate in the longest rollouts.
    """
    if by not in ("reason", "length", "turns"):
        raise ValueError(f"--by must be reason, length or turns, got {by!r}")
    base = stats(ledger, job_id)
    out: dict[str, Any] = {
        "job_id": base["job_id"],
        "by": by,
        "expected": base["expected"],
        "dropped": base["dropped"],
        "drop_rate": base["drop_rate"],
        "rows": [],
    }
    if base["job_id"] is None:
        return out
    dropped_states = [s.value for s, c in TERMINAL_CLASS.items() if c is TerminalClass.DROPPED]
    with ledger.engine.connect() as conn:
        rows = conn.execute(
            select(Rollout.state, Rollout.completion_tokens, Rollout.turns, Rollout.reason).where(
                Rollout.job_id == base["job_id"]
            )
        ).all()
    expected_n = len(rows)
    if by == "reason":
        per_state: Counter[str] = Counter()
        example: dict[str, str] = {}
        for state, _tok, _turns, reason in rows:
            if state in dropped_states:
                per_state[state] += 1
                if reason and state not in example:
                    example[state] = reason[:120]
        out["rows"] = [
            {
                "reason": s,
                "dropped": n,
                "share_of_expected": n / expected_n,
                "example": example.get(s),
            }
            for s, n in per_state.most_common()
        ]
        return out
    edges, col = (LENGTH_BUCKETS, 1) if by == "length" else (TURN_BUCKETS, 2)
    exp: Counter[str] = Counter()
    drp: Counter[str] = Counter()
    for row in rows:
        key = _bucket(int(row[col] or 0), edges)
        exp[key] += 1
        drp[key] += row[0] in dropped_states
    order = [_bucket(e, edges) for e in edges]
    out["rows"] = [
        {"bucket": k, "expected": exp[k], "dropped": drp[k], "drop_rate": drp[k] / exp[k]}
        for k in order
        if exp[k]
    ]
    return out


def show(ledger: Ledger, rollout_id: str) -> dict[str, Any]:
    """One rollout: its row, its state history and its event record, in order."""
    if not ledger.has_schema():
        raise UnknownRollout(f"unknown rollout {rollout_id!r}: this database holds no rlsys ledger")
    with ledger.engine.connect() as conn:
        row = (
            conn.execute(select(Rollout.__table__).where(Rollout.id == rollout_id))
            .mappings()
            .first()
        )
        if row is None:
            raise UnknownRollout(f"unknown rollout {rollout_id!r} in this ledger")
        history = (
            conn.execute(
                select(
                    RolloutTransition.seq,
                    RolloutTransition.from_state,
                    RolloutTransition.to_state,
                    RolloutTransition.at,
                    RolloutTransition.reason,
                )
                .where(RolloutTransition.rollout_id == rollout_id)
                .order_by(RolloutTransition.seq)
            )
            .mappings()
            .all()
        )
        events = (
            conn.execute(
                select(
                    RolloutEvent.kind,
                    RolloutEvent.turn,
                    RolloutEvent.at,
                    RolloutEvent.tokens,
                    RolloutEvent.data,
                )
                .where(RolloutEvent.rollout_id == rollout_id)
                .order_by(RolloutEvent.at, RolloutEvent.id)
            )
            .mappings()
            .all()
        )
        retried_as = (
            conn.execute(select(Rollout.id).where(Rollout.retry_of == rollout_id)).scalars().all()
        )
    state = RolloutState(row["state"])
    return {
        "rollout": dict(row),
        "terminal_class": TERMINAL_CLASS[state].value if state in TERMINAL_CLASS else None,
        "retried_as": list(retried_as),
        "history": [dict(h) for h in history],
        "events": [dict(e) for e in events],
    }


def trainer_steps(ledger: Ledger, job_id: str | None = None, after_step: int = 0) -> dict[str, Any]:
    """Per-step trainer metrics of a job (what `rlsys monitor` shows), oldest first."""
    from rlsys.ledger.models import TrainerStep

    if not ledger.has_schema():
        if job_id is not None:
            ledger_job_missing(job_id)
        return {"job_id": None, "steps": []}
    job_id = _resolve_job(ledger, job_id)
    if job_id is None:
        return {"job_id": None, "steps": []}
    with ledger.engine.connect() as conn:
        rows = conn.execute(
            select(
                TrainerStep.step, TrainerStep.policy_version, TrainerStep.at, TrainerStep.metrics
            )
            .where(TrainerStep.job_id == job_id, TrainerStep.step > after_step)
            .order_by(TrainerStep.step)
        ).all()
    steps = [
        {**metrics, "step": step, "policy_version": version, "at": at}
        for step, version, at, metrics in rows
    ]
    return {
        "job_id": job_id,
        "job_status": effective_status(ledger.get_job(job_id)),
        "steps": steps,
    }


def list_jobs(ledger: Ledger, limit: int = 50) -> list[dict[str, Any]]:
    """The most recent jobs with their status (`orphaned` for a live job whose driver
    stopped beating), why they ended, the driver's heartbeat age, and rollout counts."""
    from rlsys.ledger.models import Job

    if not ledger.has_schema():
        return []
    with ledger.engine.connect() as conn:
        rows = (
            conn.execute(select(Job.__table__).order_by(Job.created_at.desc()).limit(limit))
            .mappings()
            .all()
        )
        counts = dict(
            conn.execute(
                select(Rollout.job_id, func.count())
                .where(Rollout.job_id.in_([j["id"] for j in rows]))
                .group_by(Rollout.job_id)
            ).all()
        )
    return [
        {
            "id": j["id"],
            "name": j["name"],
            "status": effective_status(j),
            "end_reason": j["end_reason"],
            "created_at": j["created_at"],
            "ended_at": j["ended_at"],
            "heartbeat_age_s": round(heartbeat_age_s(j), 1),
            "rollouts": counts.get(j["id"], 0),
        }
        for j in rows
    ]


def parked_rollouts(ledger: Ledger, job_id: str) -> list[tuple[str, str, str, int | None]]:
    """(id, group_id, state, policy_version_first) of the job's scored/buffered rollouts,
    in planning order: what a resumed job trains from the stream before planning more."""
    with ledger.engine.connect() as conn:
        rows = conn.execute(
            select(Rollout.id, Rollout.group_id, Rollout.state, Rollout.policy_version_first)
            .where(
                Rollout.job_id == job_id,
                Rollout.state.in_([s.value for s in PARKED_STATES]),
            )
            .order_by(Rollout.created_at, Rollout.id)
        ).all()
    return [(r[0], r[1], r[2], r[3]) for r in rows]


def last_trainer_step(ledger: Ledger, job_id: str) -> tuple[int, int] | None:
    """(step, policy_version) of the job's newest committed optimiser step, if any."""
    with ledger.engine.connect() as conn:
        row = conn.execute(
            select(TrainerStep.step, TrainerStep.policy_version)
            .where(TrainerStep.job_id == job_id)
            .order_by(TrainerStep.step.desc())
            .limit(1)
        ).first()
    return (int(row[0]), int(row[1])) if row else None


def task_rewards(ledger: Ledger, job_id: str) -> list[tuple[str, float]]:
    """(task id, reward) of every rollout of the job that was scored, oldest first: what a
    resumed job rebuilds its per-prompt task profiles from."""
    with ledger.engine.connect() as conn:
        rows = conn.execute(
            select(Rollout.task_id, Rollout.reward)
            .where(Rollout.job_id == job_id, Rollout.reward.is_not(None))
            .order_by(Rollout.created_at, Rollout.id)
        ).all()
    return [(str(t), float(r)) for t, r in rows]
