"""The vLLM backend on tiny local Hugging Face models (dense and MoE, random weights): token
ids in and out, the per-token record, prefix caching, weight updates with versions that do
not abort in-flight requests, and the mismatch against the trainer's recompute. Real vLLM
(the CPU build here); skipped with the reason where it is not installed."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from rlsys.config.sampling import SamplingConfig
from rlsys.engine.api import GenerationRequest
from tests.hf_models import needs_vllm
from tests.trainer.helpers import behaviour, generator_trajectories, make_trainer

pytestmark = [pytest.mark.unit, needs_vllm]

VOCAB = 259


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe"])
def engine(request, hf_model_dirs):
    """A running VllmEngine per model kind, one start-up each for the whole module (one at a
    time: vLLM's in-process engine holds process-wide state)."""
    from rlsys.config.engine import EngineConfig
    from rlsys.engine.vllm_engine import VllmEngine

    cfg = EngineConfig(max_running=8, max_context_tokens=512, candidate_cap=VOCAB,
                       prefix_cache_tokens=4096)  # fmt: skip
    started = VllmEngine(str(hf_model_dirs[request.param]), cfg)
    started.kind = request.param
    yield started
    started.close()


def _recorded(trajs: list) -> torch.Tensor:
    """The engine's log-probs of the policy tokens, in order."""
    return torch.cat([behaviour(t) for t in trajs])


def _request(rid: str, prompt: list[int], max_tokens: int, seed: int | None = None,
             stop_strings: tuple[str, ...] = (), **sampling: object) -> GenerationRequest:  # fmt: skip
    """A request; the engine's candidate_cap (VOCAB) records every top-p set whole. Stop
    strings are the request's own, not the job's sampling configuration."""
    config = SamplingConfig(max_tokens_per_turn=max_tokens, **sampling)  # type: ignore[arg-type]
    return GenerationRequest(rid, rid, prompt, config, stop_strings=stop_strings, seed=seed)


def test_tokens_come_back_with_log_probs_versions_and_exact_top_p_sets(engine):
    kind = engine.kind
    prompt = torch.randint(0, VOCAB, (100,), generator=torch.Generator().manual_seed(1)).tolist()
    r = engine.generate(_request(f"{kind}-a", prompt, max_tokens=12, top_p=0.9, seed=3))
    assert r.error is None and r.finish_reason == "length" and len(r.token_ids) == 12
    assert all(0 <= t < VOCAB for t in r.token_ids) and r.versions == [0] * 12
    assert all(lp <= 0 for lp in r.logprobs) and r.routed_experts is None
    assert r.candidate_capped == [False] * 12  # the nucleus always fits in 259 log-probs
    assert all(t in c for t, c in zip(r.token_ids, r.candidate_ids, strict=True))
    assert all(0 < len(c) < VOCAB for c in r.candidate_ids)  # top-p 0.9 cuts the tail
    again = engine.generate(_request(f"{kind}-b", prompt, max_tokens=4, top_p=0.9, seed=3))
    assert again.prefix_cache_hit_tokens == 64 and again.token_ids == r.token_ids[:4]


def test_a_bad_request_fails_alone_and_the_engine_serves_on(engine):
    bad = engine.generate(_request("bad-0", [1, VOCAB + 5], max_tokens=4))
    empty = engine.generate(_request("bad-1", [], max_tokens=4))
    assert bad.finish_reason == "error" and f"not a token id in [0, {VOCAB})" in bad.error
    assert empty.finish_reason == "error" and "empty" in empty.error
    assert engine.generate(_request("ok-0", [1, 2], max_tokens=3)).token_ids


def test_a_stop_string_ends_the_turn_on_its_last_token(engine):
    from rlsys.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    first = engine.generate(_request("s-0", [5, 6, 7], max_tokens=8, seed=11))
    stop_id = next(t for t in first.token_ids[1:] if tok.encode(tok.decode([t])) == [t])
    at = first.token_ids.index(stop_id)
    stop = tok.decode([stop_id])
    r = engine.generate(_request("s-1", [5, 6, 7], max_tokens=8, seed=11, stop_strings=(stop,)))
    assert r.finish_reason == "stop" and r.token_ids == first.token_ids[: at + 1]


def test_vllm_log_probs_match_the_trainer_recompute_closely(engine, hf_model_dirs):
    from rlsys.model.hf_policy import HFPolicy

    kind = engine.kind
    trajs = generator_trajectories(engine, VOCAB, groups=2, group_size=2, turns=2, top_p=0.9)
    trainer = make_trainer(HFPolicy.from_pretrained(str(hf_model_dirs[kind])))
    recomputed = torch.cat(trainer.log_probs(trajs))
    diff = recomputed - _recorded(trajs)
    assert diff.numel() == 48 and float(diff.abs().mean()) < 1e-3, diff


def test_a_weight_update_versions_later_tokens_without_aborting_in_flight(engine, hf_model_dirs):
    from rlsys.model.hf_policy import HFPolicy

    policy = HFPolicy.from_pretrained(str(hf_model_dirs[engine.kind]))
    with torch.no_grad():
        policy.lm_head.weight.mul_(4.0)  # a visibly different policy
    long = _request(f"{engine.kind}-long", [1, 2, 3, 4], max_tokens=400, seed=5)
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(r=engine.generate(long)))
    thread.start()
    while not engine.stats().running:
        time.sleep(0.01)
    time.sleep(0.5)  # some tokens under version 0
    engine.update_weights(policy.engine_state_dict(), version=1)
    thread.join()
    r = out["r"]
    assert r.finish_reason == "length" and len(r.token_ids) == 400  # not aborted
    assert r.versions[0] == 0 and r.versions[-1] == 1
    assert r.versions == sorted(r.versions)  # one switch, old -> new

    # the new weights are the ones in use: vLLM and the trainer agree under them
    trajs = generator_trajectories(engine, VOCAB, groups=1, turns=1)
    assert all(v == 1 for t in trajs for v in t.segments[0].versions if v >= 0)
    recomputed = torch.cat(make_trainer(policy).log_probs(trajs))
    assert float((recomputed - _recorded(trajs)).abs().mean()) < 1e-3
