"""Engine log-probs equal the trainer's full-forward recompute bitwise (docs/ARCHITECTURE.md,
"Numerics"):
whatever the batch composition, prefill chunking, prefix-cache state, in fp32 and bf16."""

from __future__ import annotations

import pytest
import torch

from tests.engine.conftest import make_core, prompts, request, run_all, tiny, trainer_log_probs

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_trainer_recomputes_engine_log_probs_bitwise_in_a_mixed_batch(dtype: str) -> None:
    cfg, model = tiny(dtype)
    ps = prompts(5)
    reqs = [
        request(f"r{i}", p, temperature=0.6 + 0.2 * i, top_p=0.9, top_k=0 if i % 2 else 12)
        for i, p in enumerate(ps)
    ]
    # 3 running slots and a 16-row step budget: requests join and leave, prefills are chunked
    done = run_all(make_core(cfg, model, max_running=3, max_step_tokens=16), reqs)
    for req in reqs:
        res = done[req.request_id]
        assert res.finish_reason == "length" and len(res.token_ids) == 10
        expected = trainer_log_probs(model, req.prompt_ids, res, req.sampling.temperature)
        assert torch.equal(torch.tensor(res.logprobs), expected)


def test_a_request_samples_the_same_tokens_alone_or_batched() -> None:
    cfg, model = tiny()
    ps = prompts(4)
    alone = run_all(make_core(cfg, model), [request("x", ps[2])])["x"]
    batched = run_all(
        make_core(cfg, model, max_step_tokens=7),
        [request(f"b{i}", p) for i, p in enumerate(ps[:2])] + [request("x", ps[2])],
    )["x"]
    assert batched.token_ids == alone.token_ids and batched.logprobs == alone.logprobs
    assert batched.candidate_ids == alone.candidate_ids


def test_next_turn_hits_the_prefix_cache_and_stays_bitwise() -> None:
    cfg, model = tiny()
    core = make_core(cfg, model)
    first = prompts(1)[0] + [5, 6]
    turn1 = run_all(core, [request("t1", first)])["t1"]
    second = first + turn1.token_ids + [1, 2, 3]
    turn2 = run_all(core, [request("t2", second)])["t2"]
    assert turn2.prefix_cache_hit_tokens == len(first) + len(turn1.token_ids) - 1
    assert torch.equal(torch.tensor(turn2.logprobs), trainer_log_probs(model, second, turn2))
    fresh = run_all(make_core(cfg, model, prefix_cache_tokens=0), [request("t2", second)])["t2"]
    assert fresh.prefix_cache_hit_tokens == 0
    assert fresh.token_ids == turn2.token_ids and fresh.logprobs == turn2.logprobs
    assert core.stats().prefix_cache_hit_rate > 0.4


def test_identical_prompt_reuses_the_prompt_snapshot_and_its_routes() -> None:
    cfg, model = tiny()
    core = make_core(cfg, model)
    p = prompts(2)[1]
    a = run_all(core, [request("a", p, seed=1)])["a"]
    b = run_all(core, [request("b", p, seed=2)])["b"]
    assert b.prefix_cache_hit_tokens == len(p)
    assert torch.equal(torch.tensor(b.logprobs), trainer_log_probs(model, p, b))
    for key in ("indices", "gates"):
        assert torch.equal(a.prompt_routed_experts[key], b.prompt_routed_experts[key])
        assert torch.equal(a.routed_experts[0][key], b.routed_experts[0][key])


def test_routed_experts_replay_reproduces_the_forward() -> None:
    from rlsys.model import RoutedExperts, RoutingReplay

    cfg, model = tiny()
    p = prompts(2)[1]
    res = run_all(make_core(cfg, model), [request("a", p)])["a"]
    assert res.routed_experts[0]["indices"].dtype == torch.uint8
    rows = [RoutedExperts.from_compact(res.prompt_routed_experts)] + [
        RoutedExperts.from_compact({k: v[:, None] for k, v in r.items()})
        for r in res.routed_experts
    ]
    routes = RoutedExperts.cat(rows)
    seq = p + res.token_ids
    assert routes.num_tokens == len(seq) - 1
    with torch.no_grad():
        plain = model(torch.tensor([seq[:-1]]), with_mtp=False).logits
        replay = RoutingReplay(routes, use_gates=True)
        replayed = model(torch.tensor([seq[:-1]]), routing=replay, with_mtp=False).logits
    assert torch.equal(plain, replayed)
