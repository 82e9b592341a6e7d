"""Registry of model runners: TP=1 runs locally; TP>1 by `EngineConfig.tp_backend`
(threads or gloo processes on the CPU, NCCL processes on GPUs)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from torch import Tensor

from rlsys.config.engine import EngineConfig
from rlsys.config.model import ModelConfig
from rlsys.engine.runner import LocalRunner, ModelRunner

RunnerFactory = Callable[[ModelConfig, Mapping[str, Tensor] | None, int, int], ModelRunner]


def _dist(backend: str) -> RunnerFactory:
    def make(
        cfg: ModelConfig, state: Mapping[str, Tensor] | None, tp: int, kv_pages: int
    ) -> ModelRunner:
        from rlsys.engine.tp_dist import DistTPRunner

        return DistTPRunner(cfg, state, tp, backend, kv_pages)

    return make


def _threads(
    cfg: ModelConfig, state: Mapping[str, Tensor] | None, tp: int, kv_pages: int
) -> ModelRunner:
    from rlsys.engine.tp_threads import ThreadedTPRunner

    return ThreadedTPRunner(cfg, state, tp)


TP_BACKENDS: dict[str, RunnerFactory] = {
    "threads": _threads,
    "gloo": _dist("gloo"),
    "nccl": _dist("nccl"),
}


def make_runner(
    cfg: ModelConfig, engine_cfg: EngineConfig, state: Mapping[str, Tensor] | None
) -> ModelRunner:
    """The runner for `engine_cfg` (weights from `state`, else the model's own init)."""
    engine_cfg.check_model(cfg)
    if engine_cfg.tp == 1:
        runner = LocalRunner(
            cfg,
            state,
            engine_cfg.device,
            engine_cfg.kv_pages(),
            engine_cfg.kv_page_tokens,
            engine_cfg.record_selections,
            engine_cfg.speculative_tokens,
            engine_cfg.sample_vocab,
        )
        if engine_cfg.cuda_graphs and runner.device.type == "cuda":
            runner.enable_decode_graphs(
                engine_cfg.max_running,
                engine_cfg.max_context_tokens,
                at_start=engine_cfg.cuda_graph_capture == "start",
                candidates=engine_cfg.candidate_cap,
            )
        return runner
    return TP_BACKENDS[engine_cfg.tp_backend](cfg, state, engine_cfg.tp, engine_cfg.kv_pages())
