"""Decode steps through `DecodeGraphs` give bitwise the eager step's logits and routes.

On a GPU the steps are captured and replayed as CUDA graphs; on the CPU the same
fixed-shape step (`StaticDecodeLayout`) runs eagerly through Triton's interpreter, on a
tiny model cut to one SWA and one Sparse GQA block (the interpreter is slow).
"""

from __future__ import annotations

import pytest
import torch

from rlsys.config.engine import EngineConfig
from rlsys.config.model import preset
from rlsys.config.sampling import SamplingConfig
from rlsys.engine.api import GenerationRequest
from rlsys.engine.core import EngineCore
from rlsys.engine.runner import LocalRunner
from rlsys.model import Transformer

pytest.importorskip("triton")

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
# decode steps compared: a weight load at 3, the longest prompt (28) crosses into its second
# page (32 tokens) at 4, the batch shrinks at 6. The fewest that still cross each event: on
# the CPU every step runs through Triton's interpreter, twice (eager and graph).
STEPS = 8
LOAD_AT, SHRINK_AT = 3, 6


@pytest.fixture(autouse=True)
def triton_path(monkeypatch: pytest.MonkeyPatch) -> None:
    if not CUDA:
        monkeypatch.setenv("RLSYS_KERNELS", "triton")


def _state(dtype: str) -> tuple[object, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    small = {} if CUDA else {"n_layers": 2, "swa_per_sparse": 1}
    cfg = preset("tiny").with_overrides({"compute_dtype": dtype, "swa_window": 6, **small})
    return cfg, Transformer(cfg).state_dict()


def _runner(cfg, state, graphs: bool, at_start: bool = False, sampler: bool = False) -> LocalRunner:  # type: ignore[no-untyped-def]
    runner = LocalRunner(cfg, state, DEV, kv_pages=24, page_tokens=32)
    if graphs:
        candidates = 64 if sampler else None
        runner.enable_decode_graphs(4, 64, at_start=at_start, candidates=candidates)
    return runner


@pytest.mark.parametrize(
    ("dtype", "capture"),
    [("float32", "lazy"), ("float32", "start")] + ([("bfloat16", "lazy")] if CUDA else []),
)
def test_graph_decode_steps_are_bitwise_the_eager_steps(dtype: str, capture: str) -> None:
    cfg, state = _state(dtype)
    eager = _runner(cfg, state, False)
    graphs = _runner(cfg, state, True, at_start=capture == "start")
    assert graphs.graphs is not None
    # at start-up every ladder size of the one context bucket is built; lazily, none yet
    built_at_start = [(1, 64), (2, 64), (4, 64)] if capture == "start" else []
    assert sorted(graphs.graphs.graphs) == built_at_start
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (5, 9, 28)]
    keys = {id(r): [r.new_cache() for _ in prompts] for r in (eager, graphs)}
    for r in (eager, graphs):
        r.step(keys[id(r)], prompts)  # prefill (eager in both)
    # 3 sequences decode (graph batch 4: one padding row), then 1, across blocks and pages
    # (28 + 8 tokens > 32); new weights at LOAD_AT (the graphs' fused weights must follow
    # the in-place load)
    newer = {k: v + 0.01 * torch.randn_like(v) if v.is_floating_point() else v
             for k, v in state.items()}  # fmt: skip
    for t in range(STEPS):
        if t == LOAD_AT:
            for r in (eager, graphs):
                r.load_state_dict(newer)
        live = 3 if t < SHRINK_AT else 1
        tokens = [[(7 * t + 3 * i) % cfg.vocab_size] for i in range(live)]
        want = eager.step(keys[id(eager)][:live], tokens)
        got = graphs.step(keys[id(graphs)][:live], tokens)
        assert torch.equal(got.last_logits, want.last_logits), f"step {t}"
        assert want.routes is not None and got.routes is not None
        assert torch.equal(got.routes.indices, want.routes.indices)
        assert torch.equal(got.routes.gates, want.routes.gates)
    assert graphs.graphs.steps == STEPS
    # lazily: only the sizes the steps needed (3 rows -> batch 4, then 1); nothing new after start
    assert sorted(graphs.graphs.graphs) == (built_at_start or [(1, 64), (4, 64)])


@pytest.mark.parametrize("sampler", [False, True], ids=["host-sampler", "graph-sampler"])
def test_engine_generations_with_decode_graphs_match_the_eager_engine(sampler: bool) -> None:
    """With `sampler`, the graphs draw the tokens themselves (one host copy per step): the
    same tokens and log-probs as the eager engine's sampler."""
    cfg, state = _state("float32")
    ecfg = EngineConfig(max_running=4, max_context_tokens=64, device=DEV, prefix_cache_tokens=256)
    results = {}
    for graphs in (False, True):
        runner = _runner(cfg, state, graphs, sampler=sampler)
        core = EngineCore(cfg, ecfg, runner)
        params = SamplingConfig(max_tokens_per_turn=6, top_p=0.9)
        shared = [5, 6, 7, 8, 9, 10, 11]
        for i in range(4):  # the last two reuse the first's prompt: prefix-cache hits
            prompt = shared + [12 + i] if i < 2 else shared + [12]
            core.add(GenerationRequest(f"r{i}", f"s{i}", prompt, params, seed=3))
        done = []
        while len(done) < 4:
            done += core.step()
        results[graphs] = {r.request_id: r for r in done}
        if graphs:
            assert runner.graphs is not None and runner.graphs.steps > 0
            assert (runner.graphs.draws > 0) == sampler
    for rid, want in results[False].items():
        got = results[True][rid]
        assert got.token_ids == want.token_ids
        assert got.logprobs == want.logprobs
        assert want.finish_reason != "error", want.error


def _overlap_run(cfg, state, state2, overlap: bool, stop: int | None) -> tuple[dict, int]:  # type: ignore[no-untyped-def]
    """Two turns of a session, a third request and one continuing the first's finished
    rows exactly, a weight update after the 4th step:
    every result, and how many queued rows were taken back."""
    ecfg = EngineConfig(
        max_running=2,
        max_context_tokens=64,
        device=DEV,
        prefix_cache_tokens=256,
        overlap_decode=overlap,
    )
    runner = _runner(cfg, state, True, sampler=True)
    retracted = []
    inner = runner.retract
    runner.retract = lambda key: (retracted.append(key), inner(key))[1]  # type: ignore[method-assign]
    core = EngineCore(cfg, ecfg, runner)
    params = SamplingConfig(max_tokens_per_turn=8, top_p=0.9)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    stops = (stop,) if stop is not None else ()
    core.add(GenerationRequest("r0", "s0", prompt, params, stop_token_ids=stops, seed=3))
    core.add(GenerationRequest("r1", "s1", prompt[:-1] + [13], params, seed=4))
    done: dict = {}
    calls = 0
    while len(done) < 3:
        done |= {r.request_id: r for r in core.step()}
        calls += 1
        if calls == 4:  # both engines have emitted the same tokens here (an update settles)
            core.update_weights(state2, 1)
            core.add(GenerationRequest("r2", "s2", prompt, params, seed=5))  # waits for a slot
        assert calls < 100
    # the session's next turn continues r0's finished cache (a prefix-cache hit)
    turn = prompt + done["r0"].token_ids + [9]
    core.add(GenerationRequest("r3", "s0", turn, params, seed=6))
    # a prompt that is exactly r0's cached rows: its first token is drawn from the logits
    # r0's finish kept (no row recomputed)
    core.add(GenerationRequest("r4", "s4", prompt + done["r0"].token_ids[:-1], params, seed=7))
    while len(done) < 5:
        done |= {r.request_id: r for r in core.step()}
    assert core.stats().prefix_cache_hit_tokens > 0
    return done, len(retracted)


def test_overlapped_decode_steps_give_the_step_by_step_engines_results() -> None:
    """Overlap (each decode step queued on the device behind the previous one, fed its
    drawn tokens) against the step-by-step engine: the same tokens, log-probs, versions,
    candidates, routes and prefix-cache hits, with a sequence that stops on a stop token
    (its queued row taken back before its cache is kept) and a weight update mid-run."""
    cfg, state = _state("float32")
    torch.manual_seed(1)
    from rlsys.model import Transformer as Model

    state2 = Model(cfg).state_dict()
    first, _ = _overlap_run(cfg, state, state2, False, None)
    drawn = first["r0"].token_ids
    # r0 stops at its 6th token or later: after the update (which keeps no cache) and
    # its recompute (a prefill), at a decode step read after the next one was queued
    stop = next(t for i, t in enumerate(drawn) if i >= 5 and t not in drawn[:i])
    want, _ = _overlap_run(cfg, state, state2, False, stop)
    got, retracted = _overlap_run(cfg, state, state2, True, stop)
    n0 = len(want["r0"].token_ids)
    assert want["r0"].finish_reason == "stop" and 6 <= n0 < 8
    # r3 continued r0's finished cache: every row of r0's but the stop token's
    assert want["r3"].prefix_cache_hit_tokens == 8 + n0 - 1
    assert want["r4"].prefix_cache_hit_tokens == 8 + n0 - 1 == want["r4"].prompt_tokens
    fields = (
        "token_ids", "logprobs", "versions", "candidate_ids", "candidate_capped",
        "finish_reason", "prefix_cache_hit_tokens",
    )  # fmt: skip
    for rid, w in want.items():
        g = got[rid]
        for name in fields:
            assert getattr(g, name) == getattr(w, name), (rid, name)
        assert len(g.routed_experts) == len(w.routed_experts)
        for a, b in zip(g.routed_experts, w.routed_experts, strict=True):
            assert all(torch.equal(a[k], b[k]) for k in b), rid
        for a, b in ((g.prompt_routed_experts, w.prompt_routed_experts),):
            assert all(torch.equal(a[k], b[k]) for k in b), rid
    assert {1} <= {v for r in want.values() for v in r.versions}
    assert retracted >= 1  # the stop was seen after the next step was queued
