"""Typed messages between the actors of a job: the controller, the rollout workers, the
trainer and the engine replicas (docs/ARCHITECTURE.md, "Dependency rule": nothing crosses
an actor boundary as a bare dict). The trainer's checkpoint stores `StreamPosition` in its
record form (`as_record`), read back with `from_record`.

Invariant: no message carries token arrays. Trajectories travel worker -> stream ->
trainer; the controller sees rollout ids, states and a few numbers, so what crosses the
driver per rollout is a few hundred bytes whatever the rollout's length.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from rlsys.algo.filters import Filtered

# A JSON-shaped value: what metrics are (trackers and the ledger store them as given).
JsonValue: TypeAlias = "float | int | bool | str | None | list[JsonValue] | dict[str, JsonValue]"
Metrics: TypeAlias = "dict[str, JsonValue]"


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
class StepReport:
    """The trainer's answer to one step request: whether it stepped, the version it holds
    now, the step's metrics, the samples it excluded on purpose (zero variance, stale) and
    the stream entries the step consumed."""

    stepped: bool
    version: int
    metrics: Metrics
    filtered: list[Filtered] = field(default_factory=list)
    entries: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class StreamPosition:
    """What a trainer's checkpoint records about the stream: the step it was written at and
    the batch that step consumed (rollouts, their entries, what was filtered), so a trainer
    restored from it can be agreed with (`StepCommitter.recover`)."""

    step: int
    version: int
    job_id: str
    consumed_rollouts: list[str] = field(default_factory=list)
    consumed_entries: list[str] = field(default_factory=list)
    filtered: list[Filtered] = field(default_factory=list)
    stepped: bool = False  # the batch made an optimiser step
    metrics: Metrics = field(default_factory=dict)  # that step's trainer metrics

    def as_record(self) -> dict[str, JsonValue]:
        """The checkpoint file's form (the trainer core stores it as given)."""
        return {
            "step": self.step,
            "version": self.version,
            "job_id": self.job_id,
            "consumed_rollouts": list(self.consumed_rollouts),
            "consumed_entries": list(self.consumed_entries),
            "filtered": [[f.rollout_id, f.state, f.reason] for f in self.filtered],
            "stepped": self.stepped,
            "metrics": dict(self.metrics),
        }

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> StreamPosition | None:
        """From a checkpoint file's record; None for a checkpoint that has none (step 0)."""
        if not record:
            return None
        return cls(
            step=int(record["step"]),
            version=int(record["version"]),
            job_id=str(record.get("job_id", "")),
            consumed_rollouts=list(record.get("consumed_rollouts", [])),
            consumed_entries=list(record.get("consumed_entries", [])),
            filtered=[Filtered(*f) for f in record.get("filtered", [])],
            stepped=bool(record.get("stepped", False)),
            metrics=dict(record.get("metrics", {})),
        )


@dataclass(frozen=True, slots=True)
class TrainerPosition:
    """Where a (re)started trainer stands: its step and version, what its checkpoint says
    was consumed (None: no step recorded yet) and how many stream entries its predecessor
    left pending came back to it."""

    step: int
    version: int
    checkpoint: StreamPosition | None = None
    redelivered: int = 0

    @property
    def consumed_rollouts(self) -> list[str]:
        return self.checkpoint.consumed_rollouts if self.checkpoint else []


@dataclass(frozen=True, slots=True)
class WarmStartReport:
    """The trainer's supervised warm start on the task's demonstrations."""

    demonstrations: int
    nll_first: float
    nll_last: float


@dataclass(frozen=True, slots=True)
class ReplicaStats:
    """An engine replica's prompt tokens and prefix-cache hits since it started (what the
    step's serving metrics need, without the engine's own types: the driver stays
    torch-free)."""

    prompt_tokens: int
    prefix_cache_hit_tokens: int
