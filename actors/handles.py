"""Adapters that make Ray actor handles look like the core protocols.

`ReplicaGenerator` turns an engine replica handle into a `Generator`; a dead replica
surfaces as `ReplicaDead`, which is what makes the admission client migrate the session.
`SchedulerProxy` turns the admission actor into a `SchedulerHandle`.
"""

from __future__ import annotations

import ray
from ray.actor import ActorHandle
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from rlsys.engine.api import GenerationRequest, GenerationResult
from rlsys.rollout.admission import Ticket
from rlsys.rollout.client import ReplicaDead

_DEAD = (RayActorError, ActorDiedError, ActorUnavailableError)


class ReplicaGenerator:
    def __init__(self, replica_id: str, handle: ActorHandle, timeout_s: float = 600.0) -> None:
        self.replica_id, self.handle, self.timeout_s = replica_id, handle, timeout_s

    def generate(self, request: GenerationRequest) -> GenerationResult:
        try:
            return ray.get(self.handle.generate.remote(request), timeout=self.timeout_s)
        except _DEAD as err:
            raise ReplicaDead(
                f"engine replica {self.replica_id} died: {type(err).__name__}"
            ) from err


class SchedulerProxy:
    def __init__(self, handle: ActorHandle) -> None:
        self.handle = handle

    def acquire(self, session_id: str, request_id: str, attempt: int = 0) -> Ticket:
        return ray.get(self.handle.acquire.remote(session_id, request_id, attempt))

    def release(self, request_id: str) -> None:
        ray.get(self.handle.release.remote(request_id))

    def cancel(self, request_id: str) -> None:
        ray.get(self.handle.cancel.remote(request_id))

    def mark_dead(self, replica_id: str) -> list[str]:
        return ray.get(self.handle.mark_dead.remote(replica_id))
