"""Admission: which engine replica serves a request, and whether it may start now.

Policies (a registry): `session_affine` keeps a session on the replica it first landed on
for all its turns (its prefix stays in that replica's cache); `round_robin` and
`least_loaded` pick per request and exist as baselines for the admission benchmark.

Invariants:
- a replica runs at most `max_running` requests and queues at most `max_queue`; a request
  that cannot run waits *in place* (FIFO on its replica) and is told when to ask again;
- a session moves to another replica only when its replica is marked dead (`migrations`);
- a slot is freed exactly once per grant (`release` of an unknown grant is an error).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

Policy = Literal["session_affine", "round_robin", "least_loaded"]


@dataclass
class ReplicaSlots:
    replica_id: str
    max_running: int
    max_queue: int
    alive: bool = True
    running: set[str] = field(default_factory=set)  # request ids holding a slot
    waiting: deque[str] = field(default_factory=deque)  # request ids waiting, FIFO

    @property
    def load(self) -> int:
        return len(self.running) + len(self.waiting)


@dataclass(frozen=True)
class Ticket:
    """The answer to `acquire`: granted on `replica_id`, or wait and ask again."""

    replica_id: str
    granted: bool
    queue_position: int | None = None  # None when not even queued (queue full)
    retry_after_s: float = 0.0
    migrated_from: str | None = None


class NoLiveReplica(RuntimeError):
    """Every replica is dead: nothing can serve the request."""


class AdmissionScheduler:
    """Session-to-replica mapping with bounded per-replica queues (see module doc)."""

    def __init__(
        self,
        replica_ids: list[str],
        *,
        max_running: int = 8,
        max_queue: int = 64,
        policy: Policy = "session_affine",
        backoff_s: float = 0.005,
        max_backoff_s: float = 0.2,
    ) -> None:
        if not replica_ids:
            raise ValueError("admission needs at least one replica")
        if policy not in POLICIES:
            raise ValueError(f"unknown admission policy {policy!r}; choose from {sorted(POLICIES)}")
        self.replicas = {r: ReplicaSlots(r, max_running, max_queue) for r in replica_ids}
        self.policy = policy
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.session_replica: dict[str, str] = {}
        self.request_replica: dict[str, str] = {}
        self.request_session: dict[str, str] = {}
        self._rr = itertools.cycle(replica_ids)
        self.metrics = {"grants": 0, "waits": 0, "queue_full": 0, "migrations": 0}

    # -- choosing ---------------------------------------------------------------------
    def _live(self) -> list[ReplicaSlots]:
        live = [r for r in self.replicas.values() if r.alive]
        if not live:
            raise NoLiveReplica("no live engine replica")
        return live

    def _least_loaded(self) -> str:
        return min(self._live(), key=lambda r: (r.load, r.replica_id)).replica_id

    def _round_robin(self) -> str:
        for _ in range(len(self.replicas)):
            rid = next(self._rr)
            if self.replicas[rid].alive:
                return rid
        raise NoLiveReplica("no live engine replica")

    def _choose(self, session_id: str, request_id: str) -> tuple[str, str | None]:
        """(replica for this request, the dead replica it migrated from, if any)."""
        if request_id in self.request_replica:  # a request keeps its replica while it waits
            rid = self.request_replica[request_id]
            if self.replicas[rid].alive:
                return rid, None
        previous = self.session_replica.get(session_id)
        if self.policy == "session_affine" and previous and self.replicas[previous].alive:
            return previous, None
        rid = POLICIES[self.policy](self)
        moved = previous if previous and not self.replicas[previous].alive else None
        if moved:
            self.metrics["migrations"] += 1
        return rid, moved

    # -- the protocol ------------------------------------------------------------------
    def acquire(self, session_id: str, request_id: str, attempt: int = 0) -> Ticket:
        """Grant a slot now, or queue the request in place and say when to ask again."""
        rid, moved = self._choose(session_id, request_id)
        self.session_replica[session_id] = rid
        self.request_replica[request_id] = rid
        self.request_session[request_id] = session_id
        slots = self.replicas[rid]
        if request_id not in slots.waiting and len(slots.waiting) < slots.max_queue:
            slots.waiting.append(request_id)
        at_head = bool(slots.waiting) and slots.waiting[0] == request_id
        if at_head and len(slots.running) < slots.max_running:
            slots.waiting.popleft()
            slots.running.add(request_id)
            self.metrics["grants"] += 1
            return Ticket(rid, True, migrated_from=moved)
        delay = min(self.backoff_s * (2 ** min(attempt, 16)), self.max_backoff_s)
        if request_id in slots.waiting:
            self.metrics["waits"] += 1
            return Ticket(rid, False, slots.waiting.index(request_id), delay, moved)
        self.metrics["queue_full"] += 1
        return Ticket(rid, False, None, delay, moved)

    def release(self, request_id: str) -> None:
        """Free the slot a granted request held."""
        rid = self.request_replica.pop(request_id, None)
        self.request_session.pop(request_id, None)
        if rid is None or request_id not in self.replicas[rid].running:
            raise KeyError(f"release of request {request_id!r} that holds no slot")
        self.replicas[rid].running.discard(request_id)

    def cancel(self, request_id: str) -> None:
        """Forget a request that gave up while waiting (or whose worker died)."""
        rid = self.request_replica.pop(request_id, None)
        self.request_session.pop(request_id, None)
        if rid is not None:
            slots = self.replicas[rid]
            slots.running.discard(request_id)
            if request_id in slots.waiting:
                slots.waiting.remove(request_id)

    def cancel_sessions(self, session_ids: list[str]) -> int:
        """Free every slot and queue place held for these sessions (their worker died)."""
        doomed = [r for r, s in self.request_session.items() if s in set(session_ids)]
        for request_id in doomed:
            self.cancel(request_id)
        return len(doomed)

    def mark_dead(self, replica_id: str) -> list[str]:
        """Take a replica out; its requests are forgotten and re-acquire elsewhere."""
        slots = self.replicas[replica_id]
        if not slots.alive:
            return []
        slots.alive = False
        gone = list(slots.running) + list(slots.waiting)
        for req in gone:
            self.request_replica.pop(req, None)
        slots.running.clear()
        slots.waiting.clear()
        return gone

    def load_report(self) -> dict[str, int]:
        """Now: requests queued and running on live replicas; since the start: the counters."""
        live = [r for r in self.replicas.values() if r.alive]
        return {
            "queue_depth": sum(len(r.waiting) for r in live),
            "running": sum(len(r.running) for r in live),
            "live_replicas": len(live),
            **self.metrics,
        }

    def snapshot(self) -> dict[str, dict[str, int | bool]]:
        """Queue depth and running count per replica (metrics)."""
        return {
            r.replica_id: {"alive": r.alive, "running": len(r.running), "waiting": len(r.waiting)}
            for r in self.replicas.values()
        }


POLICIES = {
    "session_affine": AdmissionScheduler._least_loaded,  # first turn; sticky afterwards
    "round_robin": AdmissionScheduler._round_robin,
    "least_loaded": AdmissionScheduler._least_loaded,
}
