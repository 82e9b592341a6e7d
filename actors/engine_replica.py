"""An engine replica: the native `InferenceEngine` as a Ray actor.

Threaded actor (`max_concurrency` set by the caller): many rollout workers call `generate`
at once and the engine batches them continuously. Weights arrive as a state dict from
the trainer through the object store, as version v+1, without aborting in-flight requests.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import ray


@ray.remote(max_restarts=0)
class EngineReplica:
    def __init__(self, replica_id: str, job_config: dict[str, Any]) -> None:
        import torch

        from rlsys.config.job import JobConfig
        from rlsys.engine.config import EngineConfig
        from rlsys.engine.engine import InferenceEngine
        from rlsys.tokenizer import VOCAB_SIZE

        torch.set_num_threads(1)  # replicas share few cores with workers and the trainer
        cfg = JobConfig.model_validate(job_config)
        self.replica_id = replica_id
        engine_cfg = EngineConfig.from_job(cfg.engine, cfg.seed, sample_vocab=VOCAB_SIZE)
        self.engine = InferenceEngine(cfg.model.resolve(), engine_cfg)

    def ready(self) -> str:
        return self.replica_id

    def pid(self) -> int:
        return os.getpid()

    def generate(self, request: Any) -> Any:
        return self.engine.generate(request)

    def update_weights(self, state: Mapping[str, Any], version: int) -> int:
        self.engine.update_weights(state, version)
        return version

    def stats(self) -> dict[str, Any]:
        from dataclasses import asdict

        return asdict(self.engine.stats())
