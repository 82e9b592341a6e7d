"""The trainer on a Hugging Face model through the policy-model interface: the same step
(objective, TIS, candidate-set replay, zero-center, chunked LM head) and checkpoints, with
no branch on the model's kind. Behaviour log-probs here are the trainer's own recompute at
staleness 0 (the vLLM-recorded case is in tests/engine/test_vllm_engine.py)."""

import pytest
import torch

from rlsys.config.algo import AlgoConfig
from rlsys.trajectory import Segment, Trajectory
from tests.hf_models import needs_transformers
from tests.trainer.helpers import make_trainer

pytestmark = [pytest.mark.unit, needs_transformers]


def _trajectories(vocab: int, groups: int = 2, size: int = 2) -> list[Trajectory]:
    rng = torch.Generator().manual_seed(0)
    trajs = []
    for g in range(groups):
        prompt = torch.randint(0, vocab, (8,), generator=rng).tolist()
        for m in range(size):
            seg = Segment()
            seg.append(prompt, turn=-1, policy=False)
            out = torch.randint(0, vocab, (6,), generator=rng).tolist()
            # a recorded candidate set (replay) on every other token, as an engine's top-p
            cands = [sorted({t, *range(0, 40)}) if i % 2 else [] for i, t in enumerate(out)]
            seg.append(out, turn=0, policy=True, logprobs=[0.0] * 6, versions=[0] * 6,
                       candidates=cands)  # fmt: skip
            trajs.append(Trajectory(f"r{g}-{m}", f"g{g}", "t", [seg], reward=float((m + g) % 2)))
    return trajs


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_an_rl_step_on_a_hugging_face_policy(hf_model_dirs, kind, tmp_path):
    from rlsys.model.hf_policy import HFPolicy

    model = HFPolicy.from_pretrained(str(hf_model_dirs[kind]))
    trainer = make_trainer(model, AlgoConfig(objective="pg_tis"), lm_head_chunk=4)
    trajs = _trajectories(model.cfg.vocab_size)
    for traj, logp in zip(trajs, trainer.log_probs(trajs), strict=True):
        seg = traj.segments[0]
        seg.logprobs = [0.0] * 8 + logp.tolist()  # behaviour = this policy (staleness 0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = trainer.train_step(trajs)
    assert result.stepped and trainer.version == 1 and len(result.trained) == 4
    mismatch = result.metrics.mismatch
    assert mismatch is not None and mismatch["tokens"] == 24 and mismatch["max_abs"] < 1e-5
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())

    trainer.save_checkpoint(tmp_path / "ckpt")
    fresh = make_trainer(HFPolicy.from_pretrained(str(hf_model_dirs[kind])), lm_head_chunk=4)
    fresh.restore(tmp_path / "ckpt")
    assert fresh.version == 1
    for a, b in zip(fresh.log_probs(trajs), trainer.log_probs(trajs), strict=True):
        assert torch.equal(a, b)
