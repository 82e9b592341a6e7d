"""A model whose vocabulary is padded past the tokenizer's: vLLM samples only ids below
`sample_vocab`, over the same distribution the trainer recomputes with `valid_vocab`. Its
own module: one vLLM engine per process at a time (test_vllm_engine.py's are closed)."""

import pytest

from rlsys.config.sampling import SamplingConfig
from rlsys.engine.api import GenerationRequest
from tests.hf_models import needs_vllm
from tests.trainer.helpers import behaviour

pytestmark = [pytest.mark.unit, needs_vllm]


def test_only_tokenizer_ids_are_sampled_and_the_trainer_agrees(tmp_path):
    from rlsys.config.algo import AlgoConfig
    from rlsys.config.engine import EngineConfig
    from rlsys.config.job import TrainerSection
    from rlsys.engine.vllm_engine import VllmEngine
    from rlsys.model.hf_policy import HFPolicy
    from rlsys.model.hf_tiny import build_tiny
    from rlsys.trainer import Trainer
    from rlsys.trajectory import Segment, Trajectory

    path = build_tiny(tmp_path / "padded", "qwen3", vocab_size=320)
    cfg = EngineConfig(max_context_tokens=256, candidate_cap=320, sample_vocab=259)
    engine = VllmEngine(str(path), cfg)
    try:
        sampling = SamplingConfig(max_tokens_per_turn=64, top_p=0.95)
        r = engine.generate(GenerationRequest("v", "v", [300, 1, 2, 3], sampling, seed=0))
    finally:
        engine.close()
    assert r.error is None and len(r.token_ids) == 64
    assert max(r.token_ids) < 259 and max(max(c) for c in r.candidate_ids) < 259
    seg = Segment()
    seg.append([300, 1, 2, 3], turn=-1, policy=False)
    seg.append(r.token_ids, turn=0, policy=True, logprobs=r.logprobs, versions=r.versions,
               candidates=r.candidate_ids)  # fmt: skip
    traj = Trajectory("r", "g", "t", [seg], reward=0.0)
    trainer = Trainer(HFPolicy.from_pretrained(str(path)), TrainerSection(), AlgoConfig(),
                      valid_vocab=259)  # fmt: skip
    diff = trainer.log_probs([traj])[0] - behaviour(traj)
    assert float(diff.abs().max()) < 1e-5
