"""MTP speculative decoding: spec-on results are bitwise those of plain decoding.

The model (tiny, MTP depth 1) is trained for a few seconds on cyclic sequences, so its
MTP head drafts well and both the accept and the reject/rollback paths run.
"""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from rlsys.config.engine import EngineConfig
from rlsys.config.job import JobConfig
from rlsys.config.model import ModelConfig
from rlsys.engine.api import GenerationResult
from rlsys.engine.core import EngineCore
from rlsys.engine.runner import snapshot
from rlsys.model import ModelCache, SlidingKVCache, Transformer
from rlsys.model.cache_rollback import rollback
from tests.engine.conftest import make_core, request, run_all, tiny, trainer_log_probs

pytestmark = pytest.mark.unit


def _cycles(gen: torch.Generator, b: int, t: int, period: int = 7) -> torch.Tensor:
    start = torch.randint(0, period, (b, 1), generator=gen)
    base = torch.randint(0, 50, (b, 1), generator=gen)
    return base + (start + torch.arange(t)) % period


def _train(cfg: ModelConfig) -> Transformer:
    """A few seconds of training of the model and its MTP heads on cyclic sequences."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Transformer(cfg).train()
    opt = torch.optim.Adam(model.parameters(), lr=3e-2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(40):
        x = _cycles(gen, 4, 28)
        out = model(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), x[:, 1:].flatten())
        for depth, logits in enumerate(out.mtp_logits, start=1):
            head = logits[:, : x.shape[1] - 1 - depth].flatten(0, 1)
            loss = loss + torch.nn.functional.cross_entropy(head, x[:, 1 + depth :].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@pytest.fixture(scope="module")
def trained() -> tuple[ModelConfig, Transformer]:
    cfg, _ = tiny()
    return cfg, _train(cfg)


def _requests() -> list:  # type: ignore[type-arg]
    gen = torch.Generator().manual_seed(5)
    prompts = [_cycles(gen, 1, 4 + 3 * i)[0].tolist() for i in range(5)]
    return [
        request("t1", prompts[0], max_tokens=40, seed=1),
        request("cool", prompts[1], max_tokens=33, temperature=0.7, seed=2),
        request("nucleus", prompts[2], max_tokens=29, top_p=0.9, seed=3),
        request("topk", prompts[3], max_tokens=25, top_k=3, seed=4),
        request("stop", prompts[4], max_tokens=40, stop_token_ids=(prompts[4][1],), seed=5),
        # a group with one prompt: prefix-cache hits carry the drafter's state too
        *[request(f"g{i}", prompts[0], max_tokens=30, seed=10 + i) for i in range(3)],
    ]


def _assert_same(a: GenerationResult, b: GenerationResult) -> None:
    assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
    assert a.logprobs == b.logprobs and a.versions == b.versions
    assert a.candidate_ids == b.candidate_ids and a.candidate_capped == b.candidate_capped
    for x, y in zip(a.routed_experts, b.routed_experts, strict=True):
        assert all(torch.equal(x[key], y[key]) for key in ("indices", "gates"))
    for key in ("indices", "gates"):
        assert torch.equal(a.prompt_routed_experts[key], b.prompt_routed_experts[key])  # type: ignore[index]


def test_speculative_decoding_is_bitwise_plain_decoding(trained) -> None:  # type: ignore[no-untyped-def]
    cfg, model = trained
    reqs = _requests()
    plain = run_all(make_core(cfg, model, max_running=3), reqs)
    core = make_core(cfg, model, max_running=3, speculative_tokens=1)
    spec = run_all(core, reqs)
    for req in reqs:
        _assert_same(plain[req.request_id], spec[req.request_id])
    stats = core.stats()
    # both paths ran: accepted drafts and rolled-back ones; fewer steps than tokens
    assert 0 < stats.accepted_draft_tokens < stats.draft_tokens
    assert stats.steps < stats.generated_tokens
    res = spec["t1"]
    assert torch.equal(
        torch.tensor(res.logprobs), trainer_log_probs(model, reqs[0].prompt_ids, res)
    )


def test_two_drafts_per_step_are_bitwise_plain_decoding() -> None:
    """Two MTP heads: the second drafts from the first's draft (its speculative rows)."""
    cfg = tiny()[0].with_overrides({"mtp_depth": 2, "sparse_block": 4, "swa_tile": 4})
    model = _train(cfg)
    reqs = _requests()
    plain = run_all(make_core(cfg, model, max_running=3), reqs)
    core = make_core(cfg, model, max_running=3, speculative_tokens=2)
    spec = run_all(core, reqs)
    for req in reqs:
        _assert_same(plain[req.request_id], spec[req.request_id])
    stats = core.stats()
    # more than one accepted draft per verify on average: second drafts are accepted too
    verifies = stats.draft_tokens / 2
    assert stats.accepted_draft_tokens > 1.2 * verifies
    assert stats.accepted_draft_tokens < stats.draft_tokens


def test_weight_update_mid_generation_matches_plain_decoding(trained) -> None:  # type: ignore[no-untyped-def]
    cfg, model = trained
    other = Transformer(cfg)
    other.load_state_dict(model.state_dict())
    with torch.no_grad():
        other.lm_head.mul_(0.5)
    req = request("u", _cycles(torch.Generator().manual_seed(9), 1, 6)[0].tolist(), max_tokens=40)

    def run(core: EngineCore, update_at: int | None) -> tuple[GenerationResult, int]:
        core.add(req)
        done: list[GenerationResult] = []
        while core.has_work():
            done += core.step()
            # tokens generated so far (a result's lists are complete once it is returned)
            n = core.running[0].num_generated if core.running else 0
            if update_at is None and n >= 12 or update_at is not None and n == update_at:
                core.update_weights(other.state_dict(), 1)
                update_at = -1
        return done[0], n

    spec_core = make_core(cfg, model, speculative_tokens=1)
    spec, _ = run(spec_core, None)
    at = spec.versions.index(1)
    plain, _ = run(make_core(cfg, model), at)
    _assert_same(plain, spec)
    assert spec.versions.count(1) > 0 and spec_core.stats().accepted_draft_tokens > 0


def test_rollback_equals_the_cache_of_the_kept_rows() -> None:
    cfg, model = tiny()
    torch.manual_seed(3)
    tokens = torch.randint(0, cfg.vocab_size, (40,))
    # a verify chunk of 2 rows (tiny: Sparse GQA block 2, SWA tile 4) from every phase of
    # the blocks and tiles, keeping 1 or 0 of its draft rows
    for start, length in [(p, p + keep) for p in range(14, 22) for keep in (1, 2)]:
        kept = model.new_cache()
        with torch.inference_mode():
            model.forward_step([tokens[:length]], [kept])
            fed = model.new_cache()
            model.forward_step([tokens[:start]], [fed])
            before = snapshot(fed)  # type: ignore[arg-type]
            model.forward_step([tokens[start : start + 2]], [fed])
        back = rollback(before, fed, length, cfg)  # type: ignore[arg-type]
        assert back.length == kept.length  # type: ignore[union-attr]
        for a, b in zip(back.layers, kept.layers, strict=True):  # type: ignore[union-attr]
            assert type(a) is type(b)
            for name in ("k", "v"):
                assert torch.equal(getattr(a, name), getattr(b, name))
            if isinstance(a, SlidingKVCache):
                assert a.start == b.start  # type: ignore[union-attr]
            else:
                assert torch.equal(a.block_keys, b.block_keys)  # type: ignore[union-attr]
                assert torch.equal(a.pending_index_keys, b.pending_index_keys)  # type: ignore[union-attr]
    assert isinstance(back, ModelCache)


def test_speculative_tokens_are_validated() -> None:
    with pytest.raises(ValidationError, match="speculative_tokens"):
        EngineConfig(speculative_tokens=1, tp=2)
    cfg, model = tiny()
    with pytest.raises(ValueError, match="engine.speculative_tokens"):
        make_core(cfg, model, speculative_tokens=2)  # tiny has one MTP head
    with pytest.raises(ValidationError, match="speculative_tokens"):
        JobConfig.model_validate({"engine": {"speculative_tokens": 2}})  # small: one head
