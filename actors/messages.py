"""Typed messages between the controller, the rollout workers and the trainer actor.

Invariant: no message carries token arrays. Trajectories travel worker -> stream ->
trainer; the controller sees rollout ids, states and a few numbers, so what crosses the
driver per rollout is a few hundred bytes whatever the rollout's length.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Assignment:
    """One planned rollout handed to a worker."""

    rollout_id: str
    group_id: str
    task_index: int
    session_id: str


@dataclass(frozen=True, slots=True)
class RolloutReport:
    """What a worker answers for one assignment: the rollout's state (`scored`, or the
    named failed state) and, when scored, the stream entry holding its trajectory, its
    reward and whether a turn of it was penalised (what sifting a group needs)."""

    rollout_id: str
    state: str
    entry_id: str | None = None
    reward: float | None = None
    penalised: bool = False
    stream_retries: int = 0  # publishes retried while the stream was unreachable


@dataclass(frozen=True, slots=True)
class Filtered:
    """A sample the trainer excluded on purpose (zero variance, stale)."""

    rollout_id: str
    state: str
    reason: str


@dataclass(frozen=True, slots=True)
class StepReport:
    """The trainer's answer to one step request."""

    stepped: bool
    version: int
    metrics: dict[str, Any]
    filtered: list[Filtered] = field(default_factory=list)
    entries: list[str] = field(default_factory=list)  # stream entries the step consumed

    @classmethod
    def from_result(cls, out: dict[str, Any]) -> StepReport:
        """From `StepResult.as_dict()` plus the entries, as the trainer actor returns it."""
        return cls(
            stepped=bool(out["stepped"]),
            version=int(out["version"]),
            metrics=dict(out["metrics"]),
            filtered=[Filtered(f["rollout_id"], f["state"], f["reason"]) for f in out["filtered"]],
            entries=list(out.get("entries", [])),
        )


@dataclass(frozen=True, slots=True)
class TrainerPosition:
    """Where a (re)started trainer stands: its checkpoint's step, version and what that
    checkpoint says was consumed (rollouts and their stream entries)."""

    step: int
    version: int
    consumed_rollouts: list[str] = field(default_factory=list)
    consumed_entries: list[str] = field(default_factory=list)
    filtered: list[Filtered] = field(default_factory=list)
    stepped: bool = False  # the checkpointed batch made an optimiser step
    metrics: dict[str, Any] = field(default_factory=dict)  # that step's trainer metrics
    redelivered: int = 0
