"""What recorded routes carry: `engine.route_gates` none sends expert ids alone (a fifth of
the bytes with fp32 gates), and indices-only replay needs nothing more."""

from __future__ import annotations

import pytest
import torch

from rlsys.config.job import JobConfig
from tests.trainer.helpers import behaviour, engine_trajectories, make_trainer, tiny_model
from tests.trainer.test_replay import _perturb_routers

pytestmark = pytest.mark.unit


def test_indices_replay_needs_no_gates() -> None:
    model = tiny_model()
    with_gates = engine_trajectories(model)
    ids_only = engine_trajectories(model, route_gates="none")
    seg = ids_only[0].segments[0]
    token = next(e for e in seg.routed_experts if e is not None)
    assert set(token) == {"indices"} and set(seg.context_routes[0][1]) == {"indices"}
    _perturb_routers(model, scale=0.5)
    trainer = make_trainer(model, replay_experts="indices")
    assert all(
        torch.equal(a, b)
        for a, b in zip(trainer.log_probs(with_gates), trainer.log_probs(ids_only), strict=True)
    )
    # and without replay the moved router shows: the ids are what the replay restored
    off = trainer.log_probs(ids_only, replay="off")
    assert not all(torch.equal(a, behaviour(t)) for a, t in zip(off, ids_only, strict=True))


def test_exact_gate_replay_refuses_routes_without_fp32_gates() -> None:
    with pytest.raises(ValueError, match="route_gates"):
        JobConfig.model_validate(
            {
                "engine": {"route_gates": "bfloat16"},
                "trainer": {"replay_experts": "indices_and_gates"},
            }
        )


def test_selection_replay_refuses_an_engine_that_does_not_record_them() -> None:
    with pytest.raises(ValueError, match="record_selections"):
        JobConfig.model_validate({"trainer": {"replay_selections": True}})
    JobConfig.model_validate(
        {"engine": {"record_selections": True}, "trainer": {"replay_selections": True}}
    )
