"""Each objective against a small example computed by hand."""

import math

import pytest
import torch

from rlsys.algo.advantages import group_relative, token_advantages
from rlsys.algo.aggregate import seq_mean, token_mean
from rlsys.algo.filters import split_stale, split_zero_variance
from rlsys.algo.kl import kl_k3
from rlsys.algo.objectives import policy_loss
from rlsys.config.algo import AlgoConfig
from rlsys.trajectory import Segment, Trajectory

pytestmark = pytest.mark.unit


def test_group_relative_advantages_by_hand():
    adv = group_relative([1.0, 0.0, 1.0, 0.0, 5.0, 5.0], ["a", "a", "a", "a", "b", "b"])
    # group a: mean 0.5, std 0.5 -> +-1; group b: zero variance -> 0
    assert adv == pytest.approx([1, -1, 1, -1, 0, 0], abs=1e-5)
    raw = group_relative([3.0, 1.0], ["g", "g"], normalize_std=False)
    assert raw == [1.0, -1.0]


def test_turn_penalty_touches_only_its_turn():
    adv = token_advantages(0.5, [-1, -1, 0, 0, 1, 1, 2], {1: -1.0}, 7)
    assert adv.tolist() == [0.5, 0.5, 0.5, 0.5, -0.5, -0.5, 0.5]


def test_aggregations_by_hand():
    loss = torch.tensor([[1.0, 2.0, 3.0], [10.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    assert token_mean(loss, mask).item() == pytest.approx(16 / 4)
    assert seq_mean(loss, mask).item() == pytest.approx((2 + 10) / 2)


def test_pg_tis_by_hand_weights_and_truncation():
    logp = torch.tensor([[math.log(0.5), math.log(0.2)]], requires_grad=True)
    behaviour = torch.tensor([[math.log(0.25), math.log(0.2)]])
    adv = torch.tensor([[1.0, -2.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    cfg = AlgoConfig(objective="pg_tis", tis_cap=1.5)
    out = policy_loss(cfg, logp, behaviour, adv, mask)
    # weights: min(0.5/0.25, 1.5) = 1.5 and 1.0 -> loss = -(1.5*1*log .5 + 1*(-2)*log .2)/2
    expected = -(1.5 * math.log(0.5) - 2 * math.log(0.2)) / 2
    assert out.loss.item() == pytest.approx(expected, rel=1e-6)
    out.loss.backward()
    assert logp.grad.tolist()[0] == pytest.approx([-1.5 / 2, 2 / 2])
    assert out.mean_importance_weight.item() == pytest.approx(1.5)
    assert out.clipped_fraction.item() == pytest.approx(0.5)


def test_staleness_zero_gives_weight_one_exactly():
    logp = torch.tensor([[-0.7, -1.3]])
    cfg = AlgoConfig()
    out = policy_loss(
        cfg,
        logp.clone().requires_grad_(),
        logp,
        torch.ones(1, 2),
        torch.ones(1, 2, dtype=torch.bool),
    )
    assert out.mean_importance_weight.item() == 1.0


def test_ppo_clip_by_hand():
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    behaviour = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[1.5, 0.9, 0.5]]))  # ratios 1.5, 0.9, 0.5
    cfg = AlgoConfig(objective="ppo_clip", clip_eps=0.2, tis_cap=10)
    out = policy_loss(cfg, logp, behaviour, adv, torch.ones(1, 3, dtype=torch.bool))
    # -min(r A, clip(r) A): 1.5 -> 1.2; 0.9 -> 0.9; A<0, r=.5: -min(-.5, -.8) = .8
    assert out.loss.item() == pytest.approx((-1.2 - 0.9 + 0.8) / 3, rel=1e-6)


def test_kl_k3_is_zero_at_equal_policies_and_positive_otherwise():
    a = torch.tensor([-1.0, -2.0])
    assert kl_k3(a, a).tolist() == [0.0, 0.0]
    assert kl_k3(a, a - 0.5).min().item() > 0
    with pytest.raises(ValueError, match="reference"):
        policy_loss(
            AlgoConfig(kl_coef=0.1), a[None], a[None], a[None], torch.ones(1, 2, dtype=torch.bool)
        )


def _traj(rid, group, reward, version, penalties=None):
    seg = Segment()
    seg.append([1, 2], turn=0, policy=True, logprobs=[-1.0, -1.0], versions=[version, version])
    return Trajectory(rid, group, "t", [seg], reward=reward, turn_penalties=penalties or {})


def test_filters_name_the_state_and_reason():
    trajs = [
        _traj("a", "g1", 1, 5),
        _traj("b", "g1", 0, 2),
        _traj("c", "g2", 1, 5),
        _traj("d", "g2", 1, 5),
    ]
    kept, stale = split_stale(trajs, current_version=5, max_staleness=2)
    assert [t.rollout_id for t in kept] == ["a", "c", "d"]
    assert stale[0].state == "filtered_stale" and "staleness 3 > bound 2" in stale[0].reason
    kept, zero = split_zero_variance(kept)
    # g1 lost its stale member: one survivor has no variance either
    assert {f.rollout_id for f in zero} == {"a", "c", "d"}
    assert zero[0].state == "filtered_zero_variance"
    penalised = [_traj("e", "g3", 0, 5, {0: -1.0}), _traj("f", "g3", 0, 5)]
    assert split_zero_variance(penalised)[1] == []
