"""Tensor parallelism over NCCL on GPUs (skipped with fewer than 2 GPUs).

The engine at TP=2 (one process per GPU, Triton kernels, the fixed 8-chunk tree over
`all_gather`) must give bitwise the log-probs of the trainer's TP=1 forward on one GPU, in
bf16, with mixed batch sizes and prefix-cache hits (the `rlsys align` workload).
"""

from __future__ import annotations

import pytest
import torch

from rlsys.config.engine import EngineConfig
from rlsys.config.model import preset
from rlsys.config.sampling import SamplingConfig
from rlsys.engine.align import alignment_report

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (one NCCL rank each)"),
]


def test_tp2_over_nccl_is_bitwise_the_trainers_tp1_forward() -> None:
    engine = EngineConfig(device="cuda", tp_backend="nccl", max_context_tokens=512)
    sampling = SamplingConfig(max_tokens_per_turn=8, top_p=0.9)
    rows = alignment_report(preset("medium"), engine, sampling, [1, 2], device="cuda")
    for row in rows:
        assert row.num_tokens > 0 and row.max_abs_logprob_diff == 0.0, row
    assert rows[1].prefix_cache_hit_tokens > 0 and rows[1].max_batch_rows > 1


def test_tp2_replica_loads_weights_received_on_its_gpu() -> None:
    """A weight update that arrives on the GPU (as the trainer's NCCL broadcast does) goes
    to the ranks GPU to GPU and serves bitwise what TP=1 serves with the same weights."""
    from rlsys.engine.api import GenerationRequest
    from rlsys.engine.engine import InferenceEngine
    from rlsys.model import Transformer

    cfg = preset("medium")
    torch.manual_seed(11)
    state = {k: v.to("cuda") for k, v in Transformer(cfg).state_dict().items()}
    base = EngineConfig(device="cuda", max_context_tokens=256, max_running=4)
    one = InferenceEngine(cfg, base)
    two = InferenceEngine(cfg, base.model_copy(update={"tp": 2, "tp_backend": "nccl"}))
    try:
        sampling = SamplingConfig(max_tokens_per_turn=12, top_p=0.9)
        results = []
        for engine in (one, two):
            engine.update_weights(state, 5)
            req = GenerationRequest("r", "r", list(range(40, 90)), sampling, seed=3)
            results.append(engine.generate(req))
        a, b = results
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
        assert b.versions == [5] * len(b.token_ids)
    finally:
        one.close()
        two.close()
