"""How the trainer's weights reach the engine replicas after each step (a registry).

- `object_store` (default): the trainer puts one CPU state dict in the Ray object store and
  every replica reads it. Simple and robust; on GPUs it costs a device -> host -> host ->
  device copy per replica.
- `collective`: the trainer broadcasts bucketed flat tensors straight to every replica
  (`rlsys.engine.weight_sync`) over a `torch.distributed` group, NCCL between GPUs, gloo
  on CPUs. The group is formed lazily for the current set of live replicas, one
  generation at a time (`rlsys.engine.sync_group`).

Invariants, for both: `publish` returns only after every replica it does not report dead
holds `version`; a replica that died (or hangs past the timeout, and is then killed) is
reported, never waited for forever. The collective transport re-forms its group from the
survivors and re-sends, so a replica death costs one timeout at most, not the job.
"""

from __future__ import annotations

from collections.abc import Callable

import ray
from ray import ObjectRef
from ray.actor import ActorHandle
from ray.exceptions import GetTimeoutError, RayActorError

from rlsys.config.engine import EngineConfig

Replicas = dict[str, ActorHandle]


class WeightSyncFailed(RuntimeError):
    """The trainer could not deliver a version to the live replicas."""


def _settle(refs: dict[str, ObjectRef], timeout_s: float) -> tuple[list[str], list[str], list[str]]:
    """Wait for every ref (bounded); returns (ok, dead, failed) keys. `dead`: the actor died
    or never answered; `failed`: it raised (alive, but its collective broke)."""
    ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    ok, dead, failed = [], [], []
    for key, ref in refs.items():
        try:
            ray.get(ref, timeout=0.1)
            ok.append(key)
        except (RayActorError, GetTimeoutError):
            dead.append(key)
        except Exception:  # noqa: BLE001 - a gloo/NCCL error inside a live actor
            failed.append(key)
    return ok, dead, failed


def _drop(replicas: Replicas, dead: list[str]) -> list[str]:
    for rid in dead:
        ray.kill(replicas[rid], no_restart=True)  # a hung replica must not come back later
    return dead


class ObjectStorePublisher:
    groups_formed = 0  # no group to form

    def __init__(self, cfg: EngineConfig) -> None:
        self.timeout_s = cfg.weight_sync_timeout_s

    def publish(self, trainer: ActorHandle, replicas: Replicas, version: int) -> list[str]:
        state = trainer.weights.remote()
        refs = {rid: r.update_weights.remote(state, version) for rid, r in replicas.items()}
        _, dead, failed = _settle(refs, self.timeout_s)
        if failed:
            raise WeightSyncFailed(f"replicas {failed} refused weights v{version}")
        return _drop(replicas, dead)


class CollectivePublisher:
    TRAINER = "trainer"

    def __init__(self, cfg: EngineConfig) -> None:
        self.timeout_s = cfg.weight_sync_timeout_s
        self.generation = 0
        self.members: tuple[str, ...] = ()  # replica ids of the current generation, by rank

    @property
    def groups_formed(self) -> int:
        return self.generation

    def publish(self, trainer: ActorHandle, replicas: Replicas, version: int) -> list[str]:
        dead: list[str] = []
        for _ in range(3):  # a death found while forming or sending costs one more round
            live = {rid: r for rid, r in replicas.items() if rid not in dead}
            if not live:
                return dead
            if tuple(live) != self.members:
                lost = self._form(trainer, live)
                if lost is not None:
                    dead += lost
                    continue
            lost = self._send(trainer, live, version)
            if lost is None:
                return dead
            dead += lost
        raise WeightSyncFailed(
            f"weights v{version}: the broadcast group kept breaking (dead so far: {dead})"
        )

    def _form(self, trainer: ActorHandle, live: Replicas) -> list[str] | None:
        """A new generation for `live`; None on success, else the replicas found dead."""
        self.generation += 1
        self.members = ()
        rendezvous = ray.get(
            trainer.sync_listen.remote(len(live) + 1, self.generation, self.timeout_s)
        )
        refs = {self.TRAINER: trainer.sync_join.remote(rendezvous)}
        for rank, (rid, replica) in enumerate(live.items(), start=1):
            refs[rid] = replica.sync_join.remote(rendezvous, rank)
        lost = self._outcome(refs, live)
        if lost is None:
            self.members = tuple(live)
        return lost

    def _send(self, trainer: ActorHandle, live: Replicas, version: int) -> list[str] | None:
        refs = {self.TRAINER: trainer.sync_send.remote(version)}
        refs.update({rid: r.sync_receive.remote() for rid, r in live.items()})
        lost = self._outcome(refs, live)
        if lost is not None:
            self.members = ()  # broken for everyone: the next round re-forms
        return lost

    def _outcome(self, refs: dict[str, ObjectRef], live: Replicas) -> list[str] | None:
        # Collectives time out after `timeout_s` inside each member; allow for two of them
        # (the store, then the operation) before calling a silent member dead.
        ok, dead, failed = _settle(refs, 2 * self.timeout_s + 5)
        if self.TRAINER in dead:
            raise WeightSyncFailed("the trainer died or hung during a weight broadcast")
        if not dead and not failed:
            return None
        return _drop(live, dead)


PUBLISHERS: dict[str, Callable[[EngineConfig], ObjectStorePublisher | CollectivePublisher]] = {
    "object_store": ObjectStorePublisher,
    "collective": CollectivePublisher,
}


def make_publisher(cfg: EngineConfig) -> ObjectStorePublisher | CollectivePublisher:
    return PUBLISHERS[cfg.weight_transport](cfg)
