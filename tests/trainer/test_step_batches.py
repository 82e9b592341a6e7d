"""The step's micro-batches are packed as the passes reach them (`step_batches.py`): the
plan packs only the first, each later one is packed before the previous one's backward
(while the device runs that forward), and the normalisers computed without packing equal
the packed batches' own."""

from __future__ import annotations

import copy

import pytest
import torch

import rlsys.trainer.step_batches as step_batches
from rlsys.config.algo import AlgoConfig
from rlsys.trainer.batch import micro_batches, pack
from rlsys.trainer.step_batches import group_rows, policy_samples
from tests.trainer.helpers import engine_trajectories, make_trainer, tiny_model

pytestmark = pytest.mark.unit


def test_samples_and_rows_without_packing_are_the_packed_batches_own() -> None:
    trajs = engine_trajectories(tiny_model(), groups=2, group_size=3)
    groups = micro_batches(trajs, 40)
    assert len(groups) > 2
    for items in groups:
        packed = pack(items, version=0)
        assert torch.equal(policy_samples(items), packed.sample_P)
        assert group_rows(items) == packed.num_tokens


def test_each_micro_batch_is_packed_before_the_previous_ones_backward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = tiny_model()
    trajs = engine_trajectories(model, groups=2, group_size=2)
    trainer = make_trainer(model, AlgoConfig(max_staleness=10), micro_batch_tokens=40)
    n = len(micro_batches(trajs, 40))
    assert n >= 3
    events: list[str] = []
    packer = step_batches.pack
    monkeypatch.setattr(
        step_batches, "pack", lambda items, **kw: events.append("pack") or packer(items, **kw)
    )
    backward = trainer.parallel.backward
    monkeypatch.setattr(
        trainer.parallel, "backward", lambda *a: events.append("backward") or backward(*a)
    )
    assert trainer.train_step(trajs).stepped
    # the plan packs the first; every later one is packed before its predecessor's backward
    assert events == ["pack"] + ["pack", "backward"] * (n - 1) + ["backward"]


def test_a_segment_that_starts_with_a_policy_token_fails_the_step_before_any_pass() -> None:
    model = tiny_model()
    trajs = engine_trajectories(model, groups=1, group_size=2)
    bad = copy.deepcopy(trajs)
    bad[1].segments[0].policy_mask[0] = True
    trainer = make_trainer(model, AlgoConfig(max_staleness=10), micro_batch_tokens=40)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=f"rollout {bad[1].rollout_id}: a segment starts"):
        trainer.train_step(bad)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert trainer.step == 0 and trainer.train_step(trajs).stepped  # nothing left behind


def test_a_rank_with_no_micro_batch_of_its_own_runs_only_its_padding_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # data parallel: with fewer micro-batches than ranks, a rank's share is empty and it
    # runs weight-0 padding passes for the collectives; here the local strategy is given
    # that share, so the step must take the padding path alone (it raised, and under two
    # FSDP ranks the other rank then waited in its collective until the timeout)
    model = tiny_model()
    trajs = engine_trajectories(model, groups=1, group_size=2)
    trainer = make_trainer(model, AlgoConfig(max_staleness=10))
    monkeypatch.setattr(trainer.parallel, "share", lambda rows: ([], 1))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = trainer.train_step(trajs)
    assert result.stepped and result.metrics.num_tokens == sum(
        len(s.token_ids) for t in trajs for s in t.segments
    )
    # weight 0 everywhere: no policy gradient, the statistics restored
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items() if "load" in k)
