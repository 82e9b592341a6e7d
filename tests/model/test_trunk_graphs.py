"""Where the graphed trunk may stand in for the eager one, and the config that asks for it.

The graphs themselves run on CUDA only (`tests/trainer/test_trunk_graphs_cuda.py` checks
them bitwise against the eager trunk); here, on the CPU: the rules `TrunkGraphs.applies`
holds, that a CPU step with graphs asked for runs the eager trunk unchanged, that a deep
copy of the model (the reference policy) starts without graphs, that the config refuses
combinations a graph cannot hold with a message naming both settings, and the layout
bookkeeping (eager first, captured second, replayed after; one layout kept; the capture's
warm-ups leave no mark on the blocks' buffers; aux losses reach the caller once), with the
eager call standing in for CUDA's graph at the capture edge.
"""

from __future__ import annotations

import copy

import pytest
import torch
from pydantic import ValidationError

from rlsys.config.job import TrainerSection
from rlsys.model.attention import SeqSpan
from rlsys.model.aux import AuxLosses
from rlsys.model.routing import RoutedExperts, RoutingRecorder, RoutingReplay
from rlsys.model.trunk_graphs import TrunkGraphs
from tests.trainer.helpers import engine_trajectories, make_trainer, tiny_model


class _Cuda:
    """Stands for a CUDA token tensor: `applies` reads only `is_cuda` of it."""

    is_cuda = True


def _replay(**kw: object) -> RoutingReplay:
    routes = RoutedExperts(torch.zeros(1, 2, 1, dtype=torch.long), torch.ones(1, 2, 1))
    return RoutingReplay(routes, use_gates=False, **kw)


def test_graphs_apply_only_to_a_training_step_with_gradients_on_cuda() -> None:
    model = tiny_model(compute_dtype="bfloat16").train()
    tokens = _Cuda()
    assert TrunkGraphs.applies(model, tokens, None, recompute=False, tp=1)
    assert TrunkGraphs.applies(model, tokens, _replay(), recompute=False, tp=1)
    assert not TrunkGraphs.applies(model, torch.zeros(2), None, recompute=False, tp=1)
    assert not TrunkGraphs.applies(model, tokens, None, recompute=True, tp=1)
    assert not TrunkGraphs.applies(model, tokens, None, recompute=False, tp=2)
    assert not TrunkGraphs.applies(model, tokens, _replay(blocks=True), False, 1)
    assert not TrunkGraphs.applies(model, tokens, RoutingRecorder(), False, 1)
    with torch.no_grad():
        assert not TrunkGraphs.applies(model, tokens, None, recompute=False, tp=1)
    fp32 = tiny_model().train()  # torch._grouped_mm in fp32 syncs: no capture
    assert not TrunkGraphs.applies(fp32, tokens, None, recompute=False, tp=1)
    model.eval()
    assert not TrunkGraphs.applies(model, tokens, None, recompute=False, tp=1)


def test_a_cpu_step_with_graphs_asked_for_is_the_eager_step() -> None:
    runs = []
    for graphs in (False, True):
        model = tiny_model()
        trajs = engine_trajectories(model)
        trainer = make_trainer(model, lr=1e-3, warmup_steps=0, cuda_graphs=graphs)
        loss = trainer.train_step(trajs).metrics.loss
        runs.append((loss, [p.detach().clone() for p in model.parameters()], model))
    (loss_a, params_a, _), (loss_b, params_b, graphed) = runs
    assert loss_a == loss_b
    assert all(torch.equal(a, b) for a, b in zip(params_a, params_b, strict=True))
    assert graphed.trunk_graphs is not None and graphed.trunk_graphs.replays == 0


def test_a_copy_of_the_model_starts_without_graphs() -> None:
    model = tiny_model()
    model.set_trunk_graphs(True)
    model.trunk_graphs.replays = 3
    ref = copy.deepcopy(model)
    assert ref.trunk_graphs is not model.trunk_graphs and ref.trunk_graphs.replays == 0


@pytest.mark.parametrize(
    ("extra", "named"),
    [({"data_parallel": 2}, "data_parallel"), ({"activation_checkpointing": True}, "checkpoint")],
)
def test_the_config_refuses_what_a_graph_cannot_hold(extra: dict, named: str) -> None:
    with pytest.raises(ValidationError, match=rf"cuda_graphs.*{named}|{named}.*cuda_graphs"):
        TrainerSection(cuda_graphs=True, **extra)
    TrainerSection(cuda_graphs=False, **extra)  # each alone is fine


# ---- the bookkeeping, with the eager call standing in for CUDA's graph -------------------

SPANS_A = [SeqSpan(0, 24, 0), SeqSpan(24, 16, 0)]
SPANS_B = [SeqSpan(0, 40, 0)]


class EagerCapture:
    """Stands in for `graph_pair.capture_pair` at the CUDA edge: runs the warm-up calls it
    runs (forward and `autograd.grad`, which touch the blocks' buffers as a real capture's
    warm-ups do) and hands back the eager call, so a "replay" is the eager trunk."""

    def __init__(self) -> None:
        self.captures = 0

    def __call__(self, call: torch.nn.Module, sample: tuple, warmup: int) -> object:
        self.captures += 1
        params = [p for p in call.parameters() if p.requires_grad]
        for _ in range(warmup):
            outs = call(*sample)
            wanted = [o for o in outs if o.requires_grad]
            grads = [torch.ones_like(o) for o in wanted]
            torch.autograd.grad(wanted, [sample[0], *params], grads)  # each one used
        return call


def _builder(model: torch.nn.Module, spans: list[SeqSpan]) -> object:
    """The reference path's eager trunk over `spans` (fresh caches per block and call)."""

    def build() -> tuple[object, tuple]:
        positions = torch.cat([torch.arange(s.pos, s.pos + s.n) for s in spans])

        def run(h: torch.Tensor, routing: object, aux: AuxLosses | None) -> torch.Tensor:
            for block in model.blocks:
                caches = [block.attn.new_cache(model.dtype, "cpu") for _ in spans]
                h = block(h, positions, spans, caches, routing, aux)
            return h

        return run, (positions,)

    return build


def _rows(spans: list[SeqSpan], d: int, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(sum(s.n for s in spans), d, requires_grad=True)


def test_a_layout_runs_eagerly_then_is_captured_then_replayed_with_the_eager_values() -> None:
    eager, graphed = tiny_model(), tiny_model()
    capture = EagerCapture()
    graphs = TrunkGraphs(capture=capture)
    for call in range(4):
        h = _rows(SPANS_A, eager.cfg.d_model, seed=call)
        want_aux, got_aux = AuxLosses(), AuxLosses()
        want = _builder(eager, SPANS_A)()[0](h, None, want_aux)
        got = graphs.run(graphed.blocks, h, SPANS_A, None, got_aux, _builder(graphed, SPANS_A))
        assert torch.equal(got, want)
        assert want_aux.values.keys() == got_aux.values.keys() and want_aux.values
        assert all(torch.equal(got_aux.values[k], v) for k, v in want_aux.values.items())
        assert graphs.replays == max(0, call)  # eager, then captured and run, then replayed
    assert capture.captures == 1
    for (name, a), b in zip(eager.named_buffers(), graphed.buffers(), strict=True):
        assert torch.equal(a, b), f"{name}: the capture's warm-ups left their mark"


def test_a_replay_builds_no_layout() -> None:
    model, built = tiny_model(), []
    graphs = TrunkGraphs(capture=EagerCapture())

    def counting() -> tuple[object, tuple]:
        built.append(1)
        return _builder(model, SPANS_A)()

    for call in range(4):
        h = _rows(SPANS_A, model.cfg.d_model, call)
        graphs.run(model.blocks, h, SPANS_A, None, AuxLosses(), counting)
    assert len(built) == 2  # the eager first sighting and the capture; never a replay


def test_one_layout_is_kept_captured_and_another_repeated_one_replaces_it() -> None:
    model = tiny_model()
    capture = EagerCapture()
    graphs = TrunkGraphs(capture=capture)
    d = model.cfg.d_model

    def call(spans: list[SeqSpan]) -> None:
        h = _rows(spans, d, 0)
        graphs.run(model.blocks, h, spans, None, AuxLosses(), _builder(model, spans))

    call(SPANS_A), call(SPANS_A)  # A captured
    call(SPANS_B)  # B seen once: eager, A stays captured
    call(SPANS_A)
    assert (capture.captures, graphs.replays) == (1, 2)
    call(SPANS_B)  # B again: captured in A's place
    call(SPANS_A)  # A again: captured anew
    assert capture.captures == 3
    graphs.clear()
    call(SPANS_A)  # after a weight load: every layout is new
    assert (capture.captures, graphs.replays) == (3, 4)


def test_a_layout_whose_capture_leaves_a_parameter_without_gradient_stays_eager() -> None:
    # without aux losses nothing trains the Sparse GQA indexer: its weights get no gradient,
    # which the capture refuses; the layout then runs eagerly, with the eager values
    eager, graphed = tiny_model(), tiny_model()
    capture = EagerCapture()
    graphs = TrunkGraphs(capture=capture)
    for call in range(4):
        h = _rows(SPANS_A, eager.cfg.d_model, seed=call)
        want = _builder(eager, SPANS_A)()[0](h, None, None)
        got = graphs.run(graphed.blocks, h, SPANS_A, None, None, _builder(graphed, SPANS_A))
        assert torch.equal(got, want)
    assert (capture.captures, graphs.replays) == (1, 0)  # refused once, never tried again
    for (name, a), b in zip(eager.named_buffers(), graphed.buffers(), strict=True):
        assert torch.equal(a, b), f"{name}: the refused capture's warm-ups left their mark"


def test_the_models_packed_trunk_through_the_graph_path_is_the_eager_trunk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the branch of `Transformer._trunk_packed` a CUDA step takes (its layout builder, the
    # embedding outside the graph, the aux losses merged once), on the Triton path through
    # the interpreter, with the eager call in the graph's place and the CUDA/bf16 rule of
    # `applies` lifted: the rows, the aux losses and the gradients are the eager trunk's
    monkeypatch.setenv("RLSYS_KERNELS", "triton")
    monkeypatch.setattr(TrunkGraphs, "applies", staticmethod(lambda *a, **k: True))
    small = {"n_layers": 2, "swa_per_sparse": 1}
    spans = [SeqSpan(0, 24, 0), SeqSpan(24, 20, 0)]
    tokens = torch.randint(0, 64, (44,), generator=torch.Generator().manual_seed(0))
    runs = []
    for graphs in (False, True):
        model = tiny_model(**small).train()
        model.set_trunk_graphs(graphs)
        if graphs:
            model.trunk_graphs = TrunkGraphs(capture=EagerCapture())
        calls = []
        for _ in range(3):  # eager sighting, capture, replay
            aux = AuxLosses()
            h = model.hidden_packed(tokens, spans, None, aux)
            (h.square().mean() + aux.total()).backward()
            grads = [p.grad.clone() for p in model.blocks.parameters()]
            model.zero_grad(set_to_none=True)
            calls.append((h.detach(), {k: v.detach() for k, v in aux.values.items()}, grads))
        runs.append((calls, model.trunk_graphs.replays if graphs else 0))
    (eager, _), (graphed, replays) = runs
    assert replays == 2
    for (h_a, aux_a, g_a), (h_b, aux_b, g_b) in zip(eager, graphed, strict=True):
        assert torch.equal(h_a, h_b)
        assert aux_a.keys() == aux_b.keys() and aux_a
        assert all(torch.equal(aux_a[k], aux_b[k]) for k in aux_a)
        assert all(torch.equal(a, b) for a, b in zip(g_a, g_b, strict=True))
