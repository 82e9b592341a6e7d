"""The controller's edge: a job's live actors, as the control loop sees them.

`Controller` (`rlsys.control.controller`) decides; a `JobCluster` carries its decisions to
the rollout workers, the trainer and the engine replicas and brings back their answers as
typed messages (`rlsys.control.messages`). The Ray implementation is
`rlsys.actors.ray_cluster.RayCluster`; unit tests drive the loop through a fake of this
protocol, so the loop itself never imports Ray (docs/ARCHITECTURE.md, "Dependency rule").

Work runs asynchronously: `run_rollout` and `train_step` return an opaque `Pending` at
once; `wait` says which are done; `rollout_result` / `step_result` give the answer.
Every call that reaches an actor tells two failures apart, and raises nothing else for
them:
- `ActorDied`: the actor is gone (died, killed, unreachable); the loop replaces it;
- `TaskFailed`: the call raised inside a live actor; `cause` is what it raised.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Protocol

from rlsys.control.messages import (
    Assignment,
    JsonValue,
    RolloutReport,
    StepReport,
    StreamPosition,
    TrainerPosition,
)

# Work in flight: an opaque, hashable handle (a Ray object ref, in the Ray implementation).
Pending = Hashable


class ActorDied(Exception):
    """The actor that was to answer is gone."""


class TaskFailed(Exception):
    """The call raised inside a live actor."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


class JobCluster(Protocol):
    # -- rollout workers -------------------------------------------------------------------
    @property
    def workers(self) -> Sequence[str]:
        """The live workers' names."""
        ...

    def run_rollout(self, worker: str, assignment: Assignment) -> Pending: ...

    def rollout_result(self, pending: Pending) -> RolloutReport: ...

    def kill_worker(self, worker: str) -> None:
        """End `worker` for good: a hung or half-dead actor must not come back (and write to
        the ledger) while its rollouts are being reconciled."""
        ...

    def start_worker(self, worker: str) -> None: ...

    def cancel_sessions(self, session_ids: Sequence[str]) -> None:
        """Release the admission slots these sessions hold on the replicas."""
        ...

    # -- the trainer -----------------------------------------------------------------------
    def train_step(self, rollout_ids: Sequence[str], timeout_s: float) -> Pending: ...

    def step_result(self, pending: Pending) -> StepReport: ...

    def trainer_position(self) -> TrainerPosition: ...

    def trainer_held(self) -> list[str]:
        """Rollout ids whose stream entries the trainer holds, unacknowledged."""
        ...

    def trainer_commit(self, rollout_ids: Sequence[str], discard: Sequence[str]) -> None:
        """The ledger holds these rollouts' outcome: the trainer acknowledges their entries
        (and those of `discard`, ended untrained)."""
        ...

    def checkpoint(self, path: str, position: StreamPosition) -> None: ...

    def set_trainer_position(self, step: int, version: int) -> None: ...

    def replace_trainer(self) -> TrainerPosition:
        """Kill the trainer for good, start a new one from its checkpoint; where it stands."""
        ...

    # -- engine replicas -------------------------------------------------------------------
    @property
    def replicas(self) -> Sequence[str]:
        """The live replicas' ids."""
        ...

    def publish_weights(self, version: int) -> list[str]:
        """The trainer's weights, as `version`, on every live replica; returns the replicas
        found dead on the way (`ActorDied`: the trainer died)."""
        ...

    def drop_replica(self, replica_id: str) -> None:
        """Forget a dead replica; admission migrates its sessions."""
        ...

    def serving_metrics(self) -> dict[str, JsonValue]: ...

    # -- waiting ---------------------------------------------------------------------------
    def wait(self, pending: Sequence[Pending], timeout_s: float) -> list[Pending]:
        """Those of `pending` done within `timeout_s` (at least one, unless it times out)."""
        ...

    def cancel(self, pending: Pending) -> None: ...
