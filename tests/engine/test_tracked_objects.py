"""A running request costs the collector O(1) tracked objects per generated token.

Every object the collector tracks is walked again by each full collection, inside an
engine step; on the GPU, at a batch of 256 requests, one such pause took 167 ms. A
sequence's route log folds its one-row parts (`RouteLog`) and a token's routes are
cut from the log only when the result is made (`token_routes`), so what is left per token
is its candidate list. Before, each token kept a log part (a dict and two views) and its
own routes entry (a dict and two copies) alive for the request's whole life."""

from __future__ import annotations

import gc

import torch

from tests.engine.conftest import make_core, prompts, request, tiny


def _tracked() -> int:
    gc.collect()
    return len(gc.get_objects())


def test_tracked_objects_grow_by_at_most_two_per_generated_token() -> None:
    cfg, model = tiny()
    core = make_core(cfg, model, max_context_tokens=512)
    batch = 4
    for i, p in enumerate(prompts(batch)):
        assert core.add(request(f"r{i}", p, max_tokens=300, temperature=1.0)) is None

    def step_until(tokens: int) -> None:
        while not core.running or min(s.num_generated for s in core.running) < tokens:
            core.step()

    step_until(40)
    before, generated = _tracked(), sum(s.num_generated for s in core.running)
    step_until(240)
    grown = _tracked() - before
    per_token = grown / (sum(s.num_generated for s in core.running) - generated)
    assert per_token <= 2.0, per_token
    results: dict[str, object] = {}
    while core.has_work():
        results.update({r.request_id: r for r in core.step()})
    res = results["r0"]
    assert len(res.routed_experts) == len(res.token_ids) == 300  # type: ignore[attr-defined]
    assert isinstance(res.routed_experts[0]["indices"], torch.Tensor)  # type: ignore[attr-defined]
