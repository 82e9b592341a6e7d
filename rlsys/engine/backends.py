"""Engine backends (`engine.backend`), a registry: what one replica actor hosts.

- `native`: our `InferenceEngine` on our model (bitwise aligned with the trainer);
- `vllm`: `VllmEngine`, vLLM on a Hugging Face model (`model.kind: hf`); vLLM is imported
  only when this backend is built, so the default install needs no vLLM.

Every backend answers `ReplicaEngine`: `generate` (token ids in and out, the same
per-token record), `update_weights` (a new version, in-flight requests not aborted),
`stats` and `close`. The collective weight transport is native only (the config says so).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

from torch import Tensor

from rlsys.config.engine import EngineConfig
from rlsys.config.job import JobConfig
from rlsys.engine.api import GenerationRequest, GenerationResult
from rlsys.engine.stats import EngineStats
from rlsys.tokenizer import VOCAB_SIZE


class ReplicaEngine(Protocol):
    def generate(self, request: GenerationRequest) -> GenerationResult: ...

    def update_weights(self, state: Mapping[str, Tensor], version: int) -> None: ...

    def stats(self) -> EngineStats: ...

    def close(self) -> None: ...


def engine_config(cfg: JobConfig) -> EngineConfig:
    """The job's engine section as a replica runs it: sampling only tokenizer ids (the
    trainer's valid_vocab is the same)."""
    return cfg.engine.copy_with(sample_vocab=VOCAB_SIZE)


def _native(cfg: JobConfig) -> ReplicaEngine:
    from rlsys.engine.engine import InferenceEngine

    return InferenceEngine(cfg.model.resolve(), engine_config(cfg))


def _vllm(cfg: JobConfig) -> ReplicaEngine:
    from rlsys.engine.vllm_engine import VllmEngine

    assert cfg.model.path is not None  # JobConfig: backend vllm serves model.kind hf
    return VllmEngine(cfg.model.path, engine_config(cfg))


ENGINE_BACKENDS: dict[str, Callable[[JobConfig], ReplicaEngine]] = {
    "native": _native,
    "vllm": _vllm,
}


def build_engine(cfg: JobConfig) -> ReplicaEngine:
    """The engine of one replica of job `cfg` (`engine.backend`)."""
    return ENGINE_BACKENDS[cfg.engine.backend](cfg)
