"""The trainer actor with `trainer.data_parallel: 2` on CPU, through a local Ray cluster.

Rank 0 (the `TrainerActor`) starts its follower, both join a gloo group; a step read from
the real SQLite stream lands where a single unsharded trainer's does, the published
weights are full tensors, the checkpoint is written once, and a follower killed mid-job
makes the trainer actor die (for the controller to restart), never hang.
"""

from __future__ import annotations

import pickle
import time
from pathlib import Path

import pytest
import ray
import torch
from ray.exceptions import RayActorError

from rlsys.actors.trainer_actor import TrainerActor
from rlsys.actors.trainer_ranks import build_trainer
from rlsys.config.job import JobConfig
from rlsys.ledger.stream import open_stream
from rlsys.trainer import load_checkpoint
from tests.trainer.helpers import engine_trajectories, tiny_model

pytestmark = pytest.mark.ray

# The bound on every collective, the ranks' join included: rank 0 waits in it until its
# follower (a new Ray worker process that imports torch and builds the model) has joined,
# which takes seconds on a quiet box and a minute or more on a loaded one. The waits end
# when the event happens; the bound only turns a dead rank into an error instead of a hang.
DP_TIMEOUT_S = 240.0
TRAINER = {
    "micro_batch_tokens": 64,
    "num_cpus": 0.5,
    "data_parallel_timeout_s": DP_TIMEOUT_S,
}
# rank 0's own bound plus the grace it gives its followers (RankGroup.collective), and room
WAIT_S = DP_TIMEOUT_S + 120


def _config(tmp_path: Path, data_parallel: int) -> JobConfig:
    return JobConfig.model_validate(
        {
            "model": {"preset": "tiny"},
            "trainer": {**TRAINER, "data_parallel": data_parallel},
            "store": {"stream_url": f"sqlite:///{tmp_path / 'stream.db'}"},
        }
    )


def test_two_rank_trainer_actor_steps_publishes_and_dies_with_its_rank(
    tmp_path: Path,
    local_ray: None,  # noqa: ARG001
) -> None:
    trajs = engine_trajectories(tiny_model(), groups=3, group_size=2, turns=2)
    cfg = _config(tmp_path, 2)
    stream = open_stream(cfg.store.stream_url)
    stream.publish_many([(t.rollout_id, pickle.dumps(t)) for t in trajs])
    ids = [t.rollout_id for t in trajs]

    actor = TrainerActor.options(num_cpus=0.5).remote(  # type: ignore[attr-defined]
        cfg, None, cfg.store.stream_url
    )
    world = ray.get(
        actor.__ray_call__.remote(lambda self: self.trainer.dp.world_size), timeout=WAIT_S
    )
    assert world == 2
    out = ray.get(actor.step.remote(ids, 30.0), timeout=WAIT_S)
    weights = ray.get(actor.weights.remote(), timeout=WAIT_S)

    single = build_trainer(_config(tmp_path, 1), None)
    ref = single.train_step(trajs)
    assert out.stepped and out.version == 1
    assert out.metrics["loss"] == pytest.approx(ref.metrics.loss, rel=1e-6)
    state = single.model.state_dict()
    assert weights.keys() == state.keys()
    for key, value in state.items():  # full, unsharded tensors
        assert weights[key].shape == value.shape, key
        torch.testing.assert_close(weights[key], value, rtol=1e-6, atol=1e-7, msg=key)

    path = tmp_path / "checkpoint"
    ray.get(actor.checkpoint.remote(str(path), None), timeout=WAIT_S)
    assert load_checkpoint(path)["model"].keys() == state.keys()

    follower = ray.get(actor.__ray_call__.remote(lambda self: self.ranks.followers[0]))
    ray.kill(follower, no_restart=True)
    started = time.monotonic()
    # the trainer actor dies (RayActorError) within the collectives' bound: a hang would
    # raise GetTimeoutError here instead
    with pytest.raises(RayActorError):
        ray.get(actor.step.remote(ids, 30.0), timeout=WAIT_S)
    elapsed = time.monotonic() - started
    print(f"trainer actor died {elapsed:.1f} s after its follower was killed")
