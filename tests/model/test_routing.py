"""Routing record/replay and its compact serialised form."""

from __future__ import annotations

import io

import pytest
import torch

from rlsys.config.model import preset
from rlsys.model import RoutedExperts, RoutingRecorder, RoutingReplay, Transformer
from rlsys.model.moe import MoE

pytestmark = pytest.mark.unit


def test_replay_with_indices_and_gates_reproduces_the_recorded_forward_bitwise() -> None:
    model = Transformer(preset("tiny"))
    tokens = torch.randint(0, 64, (2, 20))
    recorder = RoutingRecorder()
    with torch.no_grad():
        recorded = model(tokens, routing=recorder).logits
        routes = recorder.routes()
        # perturb the routers: replay must not consult them
        for block in model.blocks:
            block.ffn.router.add_(torch.randn_like(block.ffn.router))
        free = model(tokens).logits
        replayed = model(tokens, routing=RoutingReplay(routes, use_gates=True)).logits
    assert routes.indices.shape == (model.cfg.n_layers, 40, model.cfg.experts_per_token)
    assert not torch.equal(free, recorded)
    assert torch.equal(replayed, recorded)


def test_replay_of_indices_only_recomputes_gates_and_keeps_the_router_gradient() -> None:
    model = Transformer(preset("tiny"))
    tokens = torch.randint(0, 64, (1, 16))
    recorder = RoutingRecorder()
    with torch.no_grad():
        model(tokens, routing=recorder)
    out = model(tokens, routing=RoutingReplay(recorder.routes(), use_gates=False))
    out.logits.sum().backward()
    router = model.blocks[0].ffn.router
    assert router.grad is not None and router.grad.abs().sum() > 0


def test_engine_step_records_concatenate_to_the_full_forward_record() -> None:
    model = Transformer(preset("tiny")).eval()
    tokens = torch.randint(0, 64, (1, 14))
    full, parts = RoutingRecorder(), []
    with torch.no_grad():
        model(tokens, routing=full)
        cache = model.new_cache()
        for lo, hi in [(0, 9), (9, 10), (10, 14)]:
            step = RoutingRecorder()
            model.forward_step([tokens[0, lo:hi]], [cache], routing=step)
            parts.append(step.routes())
    joined = RoutedExperts.cat(parts)
    assert torch.equal(joined.indices, full.routes().indices)
    assert torch.equal(joined.gates, full.routes().gates)


@pytest.mark.parametrize("n_experts,id_dtype", [(8, torch.uint8), (300, torch.int16)])
def test_routes_round_trip_through_the_compact_serialised_form(
    n_experts: int, id_dtype: torch.dtype
) -> None:
    routes = RoutedExperts(
        indices=torch.randint(0, n_experts, (3, 50, 2)), gates=torch.rand(3, 50, 2)
    )
    compact = routes.to_compact(n_experts)
    assert compact["indices"].dtype == id_dtype and compact["gates"].dtype == torch.float32
    buffer = io.BytesIO()
    torch.save(compact, buffer)
    buffer.seek(0)
    back = RoutedExperts.from_compact(torch.load(buffer))
    assert torch.equal(back.indices, routes.indices) and torch.equal(back.gates, routes.gates)
    half = routes.to_compact(n_experts, gate_dtype="bfloat16")
    assert half["gates"].element_size() == 2


def test_bias_balancing_shifts_selection_toward_underloaded_experts() -> None:
    cfg = preset("tiny").with_overrides({"balance_bias_rate": 0.02})
    moe = MoE(cfg, 0, torch.float32).train()
    x = torch.randn(256, cfg.d_model) + 1.0
    with torch.no_grad():
        moe.router[0] = 0.1  # expert 0 scores highest for every token at first
    loads = []
    for _ in range(80):
        with torch.no_grad():
            moe(x)
        loads.append(moe.expert_load.clone())
        moe.update_balance()
    assert loads[0][0] == 256  # every token picked expert 0
    settled = torch.stack(loads[-20:]).mean(0)
    assert settled.std() < loads[0].std() / 2
    assert moe.expert_bias[0] < 0


@pytest.mark.parametrize("use_gates", [False, True])
def test_partial_replay_imposes_recorded_rows_and_routes_the_rest_by_the_router(
    use_gates: bool,
) -> None:
    moe = Transformer(preset("tiny")).blocks[0].ffn
    assert isinstance(moe, MoE)
    scores = torch.rand(6, moe.cfg.n_experts)
    own = moe._select(scores)
    recorded = RoutedExperts(
        (own + 1).remainder(moe.cfg.n_experts)[None], torch.full((1, 6, 2), 0.5)
    )
    rows = torch.tensor([True, False, True, False, False, True])
    idx, gates = moe._route(scores, RoutingReplay(recorded, use_gates=use_gates, rows=rows))
    assert torch.equal(idx[rows], recorded.indices[0][rows])
    assert torch.equal(idx[~rows], own[~rows])
    if use_gates:
        assert (gates[rows] == 0.5).all()
    assert torch.allclose(gates[~rows].sum(-1), torch.ones(3))
