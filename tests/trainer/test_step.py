"""One optimiser step: filters, advantages and objectives by hand, KL, critic, invariances."""

from __future__ import annotations

import pytest
import torch

from rlsys.config.algo import AlgoConfig, CriticConfig
from rlsys.trainer.batch import pack
from tests.trainer.helpers import behaviour, engine_trajectories, make_trainer, tiny_model

pytestmark = pytest.mark.unit


def test_stale_and_zero_variance_samples_are_returned_with_state_and_not_trained() -> None:
    model = tiny_model()
    trajs = engine_trajectories(model, groups=3, group_size=3, version=5)
    trajs[0].segments[0].versions = [3 if v >= 0 else v for v in trajs[0].segments[0].versions]
    for t in trajs[6:]:
        t.reward = 1.0  # group g2: no variance
    trainer = make_trainer(model, algo=AlgoConfig(max_staleness=1))
    trainer.version = 5
    result = trainer.train_step(trajs)
    states = {f.rollout_id: f.state for f in result.filtered}
    assert states == {
        "r0-0": "filtered_stale",
        "r2-0": "filtered_zero_variance",
        "r2-1": "filtered_zero_variance",
        "r2-2": "filtered_zero_variance",
    }
    assert sorted(result.trained) == ["r0-1", "r0-2", "r1-0", "r1-1", "r1-2"]
    assert result.metrics.num_samples == 5 and result.metrics.policy_version == 6


def test_a_batch_with_nothing_left_takes_no_step() -> None:
    model = tiny_model()
    trajs = engine_trajectories(model, groups=1)
    for t in trajs:
        t.reward = 0.5
    before = [p.detach().clone() for p in model.parameters()]
    trainer = make_trainer(model)
    result = trainer.train_step(trajs)
    assert not result.stepped and trainer.version == 0 and trainer.step == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_failed_rollouts_are_refused() -> None:
    model = tiny_model()
    trajs = engine_trajectories(model, groups=1)
    trajs[0].reward = float("nan")
    with pytest.raises(ValueError, match="NaN reward"):
        make_trainer(model).train_step(trajs)


@pytest.mark.parametrize(
    ("objective", "aggregation"), [("pg_tis", "token_mean"), ("ppo_clip", "seq_mean")]
)
def test_step_loss_by_hand_with_group_advantages_and_turn_penalty(
    objective: str, aggregation: str
) -> None:
    model = tiny_model()
    trajs = engine_trajectories(model, groups=1, group_size=2, turns=2)
    trajs[0].reward, trajs[1].reward = 1.0, 0.0
    trajs[0].turn_penalties = {1: -0.5}
    algo = AlgoConfig(objective=objective, aggregation=aggregation, normalize_std=False)
    result = make_trainer(model, algo=algo, replay_experts="off").train_step(trajs)
    # advantages: rewards 1, 0 -> +0.5, -0.5; trajectory 0's turn-1 tokens get -0.5 more
    per_sample = []
    for t, base in zip(trajs, [0.5, -0.5], strict=True):
        seg = t.segments[0]
        turns = torch.tensor(
            [tu for tu, m in zip(seg.turn_index, seg.policy_mask, strict=True) if m]
        )
        adv = base + torch.where(turns == 1, torch.tensor(t.turn_penalties.get(1, 0.0)), 0.0)
        # at staleness 0 the ratio is exactly 1: pg_tis -> -A logp, ppo_clip -> -A
        per_sample.append(-adv * behaviour(t) if objective == "pg_tis" else -adv)
    if aggregation == "token_mean":
        expected = torch.cat(per_sample).mean()
    else:
        expected = torch.stack([p.mean() for p in per_sample]).mean()
    assert result.metrics.pg_loss == pytest.approx(float(expected), rel=1e-5)


def test_turn_penalty_reaches_only_the_tokens_of_its_turn() -> None:
    model = tiny_model()
    traj = engine_trajectories(model, groups=1, group_size=1, turns=3)[0]
    traj.turn_penalties = {1: -0.25}
    batch = pack([(0, traj.segments[0], traj)])
    seg = traj.segments[0]
    turns = torch.tensor([t for t, m in zip(seg.turn_index, seg.policy_mask, strict=True) if m])
    assert torch.equal(batch.penalties_P != 0, turns == 1)
    assert torch.equal(batch.returns_P, traj.reward + batch.penalties_P)


def test_micro_batch_split_does_not_change_the_step() -> None:
    trajs = engine_trajectories(tiny_model(), groups=3)
    results = [
        make_trainer(tiny_model(), micro_batch_tokens=n, lm_head_chunk=c).train_step(trajs).metrics
        for n, c in [(10_000, 0), (30, 5)]
    ]
    # equal up to fp32 summation order (terms of size ~1 cancel to ~1e-3)
    assert results[0].pg_loss == pytest.approx(results[1].pg_loss, abs=1e-6)
    assert results[0].loss == pytest.approx(results[1].loss, abs=1e-6)
    assert results[0].grad_norm == pytest.approx(results[1].grad_norm, rel=1e-4)


def test_kl_to_the_reference_starts_at_zero_and_grows() -> None:
    model = tiny_model()
    trainer = make_trainer(model, algo=AlgoConfig(kl_coef=0.1), lr=1e-2)
    kls = []
    for step in range(3):
        trajs = engine_trajectories(model, version=trainer.version, seed=step)
        kls.append(trainer.train_step(trajs).metrics.kl)
    assert kls[0] == pytest.approx(0.0, abs=1e-7)
    assert kls[-1] > 1e-5
    fresh = engine_trajectories(model, version=trainer.version, seed=9)
    assert trainer.train_step(fresh).metrics.kl_source == "reference"


def test_critic_pretrains_then_becomes_the_baseline() -> None:
    model = tiny_model()
    critic = CriticConfig(enabled=True, warmup_updates=5, lr=1e-2)
    trainer = make_trainer(model, algo=AlgoConfig(critic=critic))
    trajs = engine_trajectories(model, groups=2)
    first = trainer.train_step(trajs).metrics
    assert not first.critic_baseline  # 0 updates < 5: the group baseline is used
    losses = trainer.pretrain_critic(trajs, steps=20)
    assert losses[-1] < losses[0] / 2
    trajs = engine_trajectories(model, version=trainer.version, seed=1)
    assert trainer.train_step(trajs).metrics.critic_baseline
