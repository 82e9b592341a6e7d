"""`HFPolicy`: a Hugging Face causal LM behind the trainer's policy-model interface, loaded
from a tiny local model directory (dense and MoE)."""

import pytest
import torch

from rlsys.model.attention import SeqSpan
from tests.hf_models import needs_transformers

pytestmark = [pytest.mark.unit, needs_transformers]


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_packed_rows_give_the_hugging_face_forward_logits(hf_model_dirs, kind):
    from transformers import AutoModelForCausalLM

    from rlsys.model.hf_policy import HFPolicy

    path = str(hf_model_dirs[kind])
    policy = HFPolicy.from_pretrained(path).eval()
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    a, b = torch.randint(0, 259, (7,)), torch.randint(0, 259, (12,))
    with torch.no_grad():
        h = policy.hidden_packed(torch.cat([a, b]), [SeqSpan(0, 7, 0), SeqSpan(7, 12, 0)])
        packed = policy.logits(h)
        expected = torch.cat([reference(a[None]).logits[0], reference(b[None]).logits[0]])
    assert h.shape == (19, policy.cfg.d_model) and policy.cfg.vocab_size == 259
    torch.testing.assert_close(packed, expected, rtol=1e-5, atol=1e-5)


def test_published_weights_have_the_serialised_names_and_layout(hf_model_dirs, tmp_path):
    from safetensors.torch import load_file

    from rlsys.model.hf_policy import HFPolicy

    path = hf_model_dirs["qwen3_moe"]
    policy = HFPolicy.from_pretrained(str(path))
    saved = load_file(str(path / "model.safetensors"))
    published = policy.engine_state_dict()
    assert set(published) == set(saved)  # per-expert names, as vLLM loads them
    assert all(torch.equal(published[k], saved[k]) for k in saved)
    with torch.no_grad():
        policy.lm_head.weight.add_(1.0)
    policy.save_pretrained(str(tmp_path / "out"))
    again = HFPolicy.from_pretrained(str(tmp_path / "out"))
    assert torch.equal(again.lm_head.weight, policy.lm_head.weight)


def test_the_registry_builds_each_kind(hf_model_dirs):
    from rlsys.config.job import ModelSection
    from rlsys.model import Transformer
    from rlsys.model.hf_policy import HFPolicy
    from rlsys.model.policy import build_policy

    hf = ModelSection(kind="hf", path=str(hf_model_dirs["qwen3"]))
    assert isinstance(build_policy(hf), HFPolicy)
    assert isinstance(build_policy(ModelSection(preset="tiny")), Transformer)
