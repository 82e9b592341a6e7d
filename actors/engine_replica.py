"""An engine replica: one engine backend (`engine.backend`: native or vllm) as a Ray actor.

Threaded actor (`max_concurrency` set by the caller): many rollout workers call `generate`
at once and the engine batches them continuously. Weights arrive as version v+1 without
aborting in-flight requests, either as a state dict through the object store
(`update_weights`) or by a collective broadcast from the trainer (`sync_join`,
`sync_receive`; see `rlsys.actors.weight_publish`). A replica Ray gave a GPU runs there.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import ray

from rlsys.config.job import JobConfig
from rlsys.control.messages import ReplicaStats
from rlsys.engine.api import GenerationRequest, GenerationResult

if TYPE_CHECKING:  # torch is imported inside the actor's process only
    from torch import Tensor

    from rlsys.engine.sync_group import Rendezvous
    from rlsys.engine.weight_sync import BucketPlan


@ray.remote(max_restarts=0)
class EngineReplica:
    def __init__(self, replica_id: str, cfg: JobConfig) -> None:
        import torch

        from rlsys.engine import gc_steps
        from rlsys.engine.backends import build_engine, engine_config
        from rlsys.engine.gc_freeze import freeze_startup_objects
        from rlsys.engine.sync_group import GroupMember

        torch.set_num_threads(1)  # replicas share few cores with workers and the trainer
        self.replica_id = replica_id
        engine_cfg = engine_config(cfg)
        self.engine = build_engine(cfg)
        # where a broadcast lands: the replica's GPU (TP over NCCL: rank 0's, from which the
        # ranks copy their shards over P2P); TP over CPU processes or threads: the host
        gpu_tp = engine_cfg.tp_backend == "nccl"
        self.device = engine_cfg.device if engine_cfg.tp == 1 or gpu_tp else "cpu"
        self.model_cfg = cfg.model.resolve()
        self.sync = GroupMember()
        self.plan: BucketPlan | None = None  # the weight-broadcast bucket plan, once needed
        # this process owns its engine for life: full collections skip the start-up's objects,
        # and run at the scheduler's step boundaries, never inside a step (`gc_steps`)
        freeze_startup_objects()
        gc_steps.take_over()

    def ready(self) -> str:
        return self.replica_id

    def pid(self) -> int:
        return os.getpid()

    def generate(self, request: GenerationRequest) -> GenerationResult:
        return self.engine.generate(request)

    def update_weights(self, state: dict[str, Tensor], version: int) -> int:
        self.engine.update_weights(state, version)
        return version

    def sync_join(self, rendezvous: Rendezvous, rank: int) -> int:
        self.sync.join(rendezvous, rank)
        return rank

    def sync_receive(self) -> int:
        """Receive one broadcast (blocks until the trainer sends) and load it."""
        from rlsys.engine.weight_sync import receive

        version, state = receive(self._sync_plan(), device=self.device)
        self.engine.update_weights(state, version)
        return version

    def _sync_plan(self) -> BucketPlan:
        """The bucket plan both sides derive from the model's names, shapes and dtypes
        (built once, on the meta device: no memory)."""
        if self.plan is None:
            import torch

            from rlsys.engine.weight_sync import plan_buckets
            from rlsys.model import Transformer

            with torch.device("meta"):
                self.plan = plan_buckets(Transformer(self.model_cfg).state_dict())
        return self.plan

    def stats(self) -> ReplicaStats:
        s = self.engine.stats()
        return ReplicaStats(s.prompt_tokens, s.prefix_cache_hit_tokens)
