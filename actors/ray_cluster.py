"""The controller's edge on Ray: `JobCluster` (`rlsys.control.cluster`) over a job's actors.

Transport only, no decisions: each call becomes an actor call, and Ray's two failures
become the protocol's: `RayActorError` (the actor died; tested first, it is not a
subclass of `RayTaskError`) is `ActorDied`, `RayTaskError` (an exception inside a live
actor) is `TaskFailed` with the actor's exception as its cause. Weights travel by the
configured transport (`rlsys.actors.weight_publish`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import ray
from ray.actor import ActorHandle
from ray.exceptions import RayActorError, RayTaskError

from rlsys.actors.serving_metrics import serving_metrics
from rlsys.actors.weight_publish import make_publisher
from rlsys.config.engine import EngineConfig
from rlsys.control.cluster import ActorDied, Pending, TaskFailed
from rlsys.control.messages import (
    Assignment,
    JsonValue,
    RolloutReport,
    StepReport,
    StreamPosition,
    TrainerPosition,
)


@dataclass
class JobHandles:
    """A job's live actors, by role."""

    admission: ActorHandle
    replicas: dict[str, ActorHandle]
    workers: dict[str, ActorHandle]
    trainer: ActorHandle

    def all(self) -> list[ActorHandle]:
        return [*self.workers.values(), *self.replicas.values(), self.trainer, self.admission]


@contextmanager
def _translated() -> Iterator[None]:
    """Ray's failures as the protocol's."""
    try:
        yield
    except RayActorError as err:
        raise ActorDied(str(err)) from err
    except RayTaskError as err:
        raise TaskFailed(err.cause or err) from err


class RayCluster:
    def __init__(
        self,
        handles: JobHandles,
        engine: EngineConfig,
        make_worker: Callable[[str], ActorHandle],
        make_trainer: Callable[[], ActorHandle],
    ) -> None:
        self.h, self.make_worker, self.make_trainer = handles, make_worker, make_trainer
        self.publisher = make_publisher(engine)

    # -- rollout workers -------------------------------------------------------------------
    @property
    def workers(self) -> list[str]:
        return list(self.h.workers)

    def run_rollout(self, worker: str, assignment: Assignment) -> Pending:
        return self.h.workers[worker].run.remote(assignment)

    def rollout_result(self, pending: Pending) -> RolloutReport:
        with _translated():
            return ray.get(pending)

    def kill_worker(self, worker: str) -> None:
        ray.kill(self.h.workers.pop(worker), no_restart=True)

    def start_worker(self, worker: str) -> None:
        self.h.workers[worker] = self.make_worker(worker)

    def cancel_sessions(self, session_ids: Sequence[str]) -> None:
        ray.get(self.h.admission.cancel_sessions.remote(list(session_ids)))

    # -- the trainer -----------------------------------------------------------------------
    def train_step(self, rollout_ids: Sequence[str], timeout_s: float) -> Pending:
        return self.h.trainer.step.remote(list(rollout_ids), timeout_s)

    def step_result(self, pending: Pending) -> StepReport:
        with _translated():
            return ray.get(pending)

    def trainer_position(self) -> TrainerPosition:
        with _translated():
            return ray.get(self.h.trainer.position.remote())

    def trainer_held(self) -> list[str]:
        with _translated():
            return ray.get(self.h.trainer.held.remote())

    def trainer_commit(self, rollout_ids: Sequence[str], discard: Sequence[str]) -> None:
        with _translated():
            ray.get(self.h.trainer.commit.remote(list(rollout_ids), list(discard)))

    def checkpoint(self, path: str, position: StreamPosition) -> None:
        with _translated():
            ray.get(self.h.trainer.checkpoint.remote(path, position))

    def set_trainer_position(self, step: int, version: int) -> None:
        with _translated():
            ray.get(self.h.trainer.set_position.remote(step, version))

    def replace_trainer(self) -> TrainerPosition:
        ray.kill(self.h.trainer, no_restart=True)
        self.h.trainer = self.make_trainer()
        return self.trainer_position()

    # -- engine replicas -------------------------------------------------------------------
    @property
    def replicas(self) -> list[str]:
        return list(self.h.replicas)

    def publish_weights(self, version: int) -> list[str]:
        with _translated():
            return self.publisher.publish(self.h.trainer, self.h.replicas, version)

    def drop_replica(self, replica_id: str) -> None:
        del self.h.replicas[replica_id]
        ray.get(self.h.admission.mark_dead.remote(replica_id))

    def serving_metrics(self) -> dict[str, JsonValue]:
        return serving_metrics(self.h.admission, self.h.replicas)

    # -- waiting ---------------------------------------------------------------------------
    def wait(self, pending: Sequence[Pending], timeout_s: float) -> list[Pending]:
        done, _ = ray.wait(list(pending), num_returns=1, timeout=timeout_s)
        return done

    def cancel(self, pending: Pending) -> None:
        ray.cancel(pending, force=False)
