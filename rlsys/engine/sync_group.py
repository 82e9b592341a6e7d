"""Membership of the weight-broadcast group, one generation at a time (no Ray).

The trainer (rank 0) and the live engine replicas (ranks 1..R) form one
`torch.distributed` group per *generation*. The trainer listens first (`listen`: a
TCPStore on a free port, returned to the caller), then every member joins at once (`join`
blocks until all have). When a replica dies the group is broken for everyone; the
survivors leave and a new generation (new port, new world size) is formed, so a dead
rank never blocks a later broadcast.

Invariants:
- a member is in at most one generation; `join` leaves the previous one first;
- every blocking call is bounded by the rendezvous timeout (store, init, collectives), so
  a dead peer turns into an exception, never a hang;
- `leave` is idempotent and safe after a failed collective.

The process's default group is used: an engine replica with TP > 1 runs its TP ranks in
spawned processes (`tp_dist`) or threads without `torch.distributed` (`tp_threads`), so the
replica's own process has no other group.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist


@dataclass(frozen=True)
class Rendezvous:
    """Where and how generation `generation` of the group meets."""

    host: str
    port: int
    world_size: int
    generation: int
    backend: str  # "gloo" (CPU tensors) or "nccl" (CUDA tensors)
    timeout_s: float


class GroupMember:
    """One process's handle on the broadcast group."""

    def __init__(self) -> None:
        self.generation: int | None = None
        self._store: dist.TCPStore | None = None  # kept alive while the group lives

    def listen(self, host: str, world_size: int, generation: int, backend: str,
               timeout_s: float) -> Rendezvous:  # fmt: skip
        """Rank 0 only: open the store of a new generation; returns where to meet."""
        self.leave()
        store = dist.TCPStore(
            host,
            0,  # the OS picks a free port: no race with another job on the node
            world_size,
            is_master=True,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
        self._store = store
        return Rendezvous(host, store.port, world_size, generation, backend, timeout_s)

    def join(self, rendezvous: Rendezvous, rank: int) -> None:
        """Block until all `world_size` members have joined generation `rendezvous.generation`."""
        timeout = timedelta(seconds=rendezvous.timeout_s)
        if rank == 0:
            if self._store is None:
                raise RuntimeError("rank 0 must listen before it joins")
            store = self._store
        else:
            self.leave()
            store = dist.TCPStore(
                rendezvous.host, rendezvous.port, rendezvous.world_size, is_master=False,
                timeout=timeout,
            )  # fmt: skip
            self._store = store
        dist.init_process_group(
            rendezvous.backend, store=store, rank=rank, world_size=rendezvous.world_size,
            timeout=timeout,
        )  # fmt: skip
        self.generation = rendezvous.generation

    def leave(self) -> None:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a group broken by a dead peer may fail to tear down cleanly
                pass
        self.generation = None
        self._store = None
