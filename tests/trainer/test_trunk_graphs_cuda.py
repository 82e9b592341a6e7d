"""The trainer's trunk as CUDA graphs (`trainer.cuda_graphs`) trains bitwise the eager trunk.

Two trainers from the same seed, one with graphs, one without, take the same steps on the
same engine trajectories, four micro-batches of one layout per step: every step's loss and
every parameter after the steps must be equal bitwise, and the graphed trainer must really
have replayed graphs (a layout is captured on its second sighting). Several micro-batches
per step are the point: a graphed backward writes its static gradient buffers, which the
next replay overwrites, so a step's first micro-batch must copy them into `.grad` and the
others add into it (PyTorch issue 181723; `graph_pair.accumulate_gradients`).
"""

from __future__ import annotations

import pytest
import torch

from tests.trainer.helpers import engine_trajectories, make_trainer, tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("replay", ["off", "indices", "indices_and_gates"])
def test_graphed_trunk_trains_bitwise_the_eager_trunk(replay: str) -> None:
    runs = []
    for graphs in (False, True):
        model = tiny_model(compute_dtype="bfloat16").cuda()
        trajs = engine_trajectories(model, device="cuda")
        # one 30-token segment per micro-batch: four micro-batches of one layout per step,
        # so gradients accumulate across graph replays (the first of a step included)
        trainer = make_trainer(
            model,
            replay_experts=replay,
            lr=1e-3,
            warmup_steps=0,
            cuda_graphs=graphs,
            micro_batch_tokens=30,
        )
        losses = [trainer.train_step(trajs).metrics.loss for _ in range(4)]
        params = [p.detach().clone() for p in model.parameters()]
        replays = model.trunk_graphs.replays if model.trunk_graphs is not None else 0
        runs.append((losses, params, replays))
    (eager_losses, eager_params, _), (graph_losses, graph_params, replays) = runs
    assert replays >= 10, "the graphed trainer did not replay its graph"
    assert graph_losses == eager_losses
    for a, b in zip(eager_params, graph_params, strict=True):
        assert torch.equal(a, b)
