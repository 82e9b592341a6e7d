"""The worker's side of admission: acquire a slot, generate, release; wait, retry, migrate.

`AdmittedGenerator` is a `Generator` that a scaffold drives as if it talked to one engine.
Underneath, every request asks the scheduler for a slot on its session's replica; while the
replica is saturated it waits in place and asks again after the scheduler's backoff; if the
replica dies mid-request, the scheduler is told, the session migrates, and the request is
re-run elsewhere (its prefix is recomputed there). Each wait, retry and migration is
reported through `on_event`, which the actor layer writes to the ledger.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from rlsys.engine.api import GenerationRequest, GenerationResult, Generator
from rlsys.rollout.admission import Ticket

EventFn = Callable[[str, dict[str, Any]], None]


class ReplicaDead(RuntimeError):
    """Raised by a replica handle when its replica is gone (actor died, process exited)."""


class SchedulerHandle(Protocol):
    def acquire(self, session_id: str, request_id: str, attempt: int = 0) -> Ticket: ...
    def release(self, request_id: str) -> None: ...
    def cancel(self, request_id: str) -> None: ...
    def mark_dead(self, replica_id: str) -> list[str]: ...


class AdmissionTimeout(RuntimeError):
    """A request waited longer than its budget without getting a slot."""


class AdmittedGenerator:
    """A `Generator` that goes through admission (see module doc)."""

    def __init__(
        self,
        scheduler: SchedulerHandle,
        replicas: Mapping[str, Generator],
        on_event: EventFn,
        *,
        max_wait_s: float = 600.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.scheduler, self.replicas, self.on_event = scheduler, replicas, on_event
        self.max_wait_s, self.sleep = max_wait_s, sleep

    def generate(self, request: GenerationRequest) -> GenerationResult:
        started, attempt, waited_on = time.monotonic(), 0, None
        while True:
            ticket = self.scheduler.acquire(request.session_id, request.request_id, attempt)
            if ticket.migrated_from:
                self.on_event("migration", {"from": ticket.migrated_from, "to": ticket.replica_id})
            if not ticket.granted:
                if waited_on is None:
                    waited_on = ticket.replica_id
                    self.on_event(
                        "admission_wait",
                        {"replica": ticket.replica_id, "queue_position": ticket.queue_position},
                    )
                if time.monotonic() - started > self.max_wait_s:
                    self.scheduler.cancel(request.request_id)
                    raise AdmissionTimeout(
                        f"no slot on {ticket.replica_id} after {self.max_wait_s}s"
                    )
                self.sleep(ticket.retry_after_s)
                attempt += 1
                continue
            if attempt:
                self.on_event(
                    "admission_retry",
                    {
                        "replica": ticket.replica_id,
                        "retries": attempt,
                        "waited_s": round(time.monotonic() - started, 4),
                    },
                )
            try:
                result = self.replicas[ticket.replica_id].generate(request)
            except ReplicaDead as err:
                self.scheduler.mark_dead(ticket.replica_id)
                self.on_event(
                    "replica_dead", {"replica": ticket.replica_id, "error": str(err)[:200]}
                )
                attempt, waited_on = 0, None
                continue
            except BaseException:
                self.scheduler.release(request.request_id)
                raise
            self.scheduler.release(request.request_id)
            return result
