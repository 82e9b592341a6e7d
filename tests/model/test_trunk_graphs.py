"""Where the graphed trunk may stand in for the eager one, and the config that asks for it.

The graphs themselves run on CUDA only (`tests/trainer/test_trunk_graphs_cuda.py` checks
them bitwise against the eager trunk); here, on the CPU: the rules `TrunkGraphs.applies`
holds, that a CPU step with graphs asked for runs the eager trunk unchanged, that a deep
copy of the model (the reference policy) starts without graphs, and that the config
refuses combinations a graph cannot hold with a message naming both settings.
"""

from __future__ import annotations

import copy

import pytest
import torch
from pydantic import ValidationError

from rlsys.config.job import TrainerSection
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
