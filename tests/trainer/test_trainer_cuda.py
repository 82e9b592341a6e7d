"""The trainer and the engine on one CUDA device: what a GPU job relies on.

A GPU job places each engine replica's model and the trainer's model on the GPU Ray gave
the actor (`engine.num_gpus`, `trainer.num_gpus`). These tests hold the same promises as
the CPU suite there: at staleness 0 the trainer's recomputed log-probs equal the engine's
bitwise (fp32 and bf16), a step trains and moves nothing back to the CPU by accident,
checkpoints restore across devices, and the warm start runs.

Runs with plain `python -m pytest tests/trainer/test_trainer_cuda.py` with the repository
installed without dependencies and only torch + pydantic: nothing here needs ray, redis
or sqlalchemy.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlsys.trainer import load_checkpoint
from tests.trainer.helpers import behaviour, engine_trajectories, make_trainer, tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("replay", ["off", "indices_and_gates"])
def test_staleness_zero_on_cuda_is_bitwise_the_engine(dtype: str, replay: str) -> None:
    model = tiny_model(compute_dtype=dtype).cuda()
    trajs = engine_trajectories(model, top_p=0.9, device="cuda")
    trainer = make_trainer(model, replay_experts=replay)
    for traj, logp in zip(trajs, trainer.log_probs(trajs), strict=True):
        assert logp.device.type == "cpu"
        assert torch.equal(logp, behaviour(traj))
    m = trainer.train_step(trajs).metrics  # the training forward (autograd) on the GPU too
    assert m.logprob_drift_max_abs == 0.0 and m.mean_importance_weight == 1.0
    assert all(p.device.type == "cuda" for p in model.parameters())


def test_a_cuda_step_matches_the_cpu_step_within_fp32_tolerance() -> None:
    cpu_model = tiny_model()
    trajs = engine_trajectories(cpu_model)
    gpu_model = tiny_model().cuda()
    for model in (cpu_model, gpu_model):
        trainer = make_trainer(model, replay_experts="indices", lr=1e-3, warmup_steps=0)
        assert trainer.train_step(trajs).stepped
    gpu_state = gpu_model.state_dict().values()
    for (name, a), b in zip(cpu_model.state_dict().items(), gpu_state, strict=True):
        torch.testing.assert_close(b.cpu(), a, atol=1e-4, rtol=1e-3, msg=name)


def test_checkpoint_written_on_cuda_restores_on_cpu_and_back(tmp_path: Path) -> None:
    model = tiny_model().cuda()
    trajs = engine_trajectories(model, device="cuda")
    trainer = make_trainer(model, lr=1e-3, warmup_steps=0)
    trainer.train_step(trajs)
    path = trainer.save_checkpoint(tmp_path / "ckpt.pt", {"consumed_entries": ["e1"]})
    on_cpu = make_trainer(tiny_model(seed=1))
    assert on_cpu.restore(path) == {"consumed_entries": ["e1"]}
    back = make_trainer(tiny_model(seed=2).cuda())
    back.restore(path)
    for a, b in zip(model.parameters(), back.model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert load_checkpoint(path)["version"] == 1
    # Adam's moments came back on the GPU, so the next step runs there.
    assert back.train_step(trajs).stepped


def test_critic_and_reference_live_on_the_models_device() -> None:
    from rlsys.config.algo import AlgoConfig, CriticConfig

    model = tiny_model().cuda()
    trajs = engine_trajectories(model, device="cuda")
    algo = AlgoConfig(kl_coef=0.1, critic=CriticConfig(enabled=True, warmup_updates=0))
    trainer = make_trainer(model, algo)
    trainer.pretrain_critic(trajs, steps=2)
    result = trainer.train_step(trajs)
    assert result.stepped and result.metrics.critic_baseline
    assert next(trainer.critic.parameters()).device.type == "cuda"


def test_warm_start_on_cuda_lowers_the_nll() -> None:
    from rlsys.rollout.demos import make_demonstrations
    from rlsys.rollout.tasks.arithmetic import ArithmeticTask, ArithmeticTaskConfig
    from rlsys.trainer import supervised_warm_start

    # the task's byte-level tokens need the byte vocabulary (the tiny preset has 64 ids)
    model = tiny_model(vocab_size=320).cuda()
    task = ArithmeticTask(ArithmeticTaskConfig(max_factor=9, max_addend=9, instructions=False))
    demos = make_demonstrations(task, 0, 32, lambda: None, slip_rate=0.25)
    nll = supervised_warm_start(
        model,
        demos,
        steps=30,  # from ln(320) = 5.78; the CPU gives 5.78 -> 3.13 with these settings
        lr=3e-3,
        batch_size=8,
        options=make_trainer(model).logprob_options,
        content_ids=task.content_token_ids,
        content_weight=1.0,
    )
    assert nll[-1] < nll[0] * 0.7, nll
