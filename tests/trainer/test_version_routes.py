"""A rollout that straddles a weight update is replayed exactly under each of its versions.

The engine computes a request's earlier rows again after an update (between two turns, or
inside one: in-flight sequences are recomputed), so a row can have been routed by two
versions. The trajectory keeps the routes each version used (`Segment.version_routes`);
a forward under version v replays v's (`pack(..., version=v)`), and every token's log-prob
is then bitwise the engine's under the weights that sampled it. Without the tables (the
per-row routes alone) the tokens of one of the versions move.
"""

from __future__ import annotations

import copy

import pytest
import torch

from rlsys.config.engine import EngineConfig
from rlsys.config.sampling import SamplingConfig
from rlsys.engine.api import GenerationRequest, GenerationResult
from rlsys.engine.core import EngineCore
from rlsys.engine.runner import LocalRunner
from rlsys.model import Transformer
from rlsys.model.moe import MoE
from rlsys.trainer.batch import pack
from rlsys.trajectory import Segment, Trajectory
from tests.trainer.helpers import behaviour, make_trainer, tiny_model

PROMPT = [5, 9, 2, 7, 3, 8, 1, 6]
OBSERVATION = [11, 12, 13]


def _moved(model: Transformer) -> Transformer:
    """The next version: routers moved enough to flip some experts, the rest nudged."""
    new = copy.deepcopy(model)
    torch.manual_seed(7)
    with torch.no_grad():
        for name, p in new.named_parameters():
            scale = 1.0 if name.endswith("router") else 0.02
            p.add_(torch.randn_like(p) * scale * p.std())
        for m in new.modules():
            if isinstance(m, MoE):
                m.expert_bias.zero_()
    return new


def _run(core: EngineCore, prompt: list[int], rid: str, update_after: int | None = None,
         state: dict | None = None) -> GenerationResult:  # fmt: skip
    params = SamplingConfig(max_tokens_per_turn=8)
    core.add(GenerationRequest(rid, "s", prompt, params, seed=3))
    steps, done = 0, []
    while not done:
        done = core.step()
        steps += 1
        if steps == update_after:
            core.update_weights(state, 1)  # type: ignore[arg-type]
    return done[0]


def _append_turn(seg: Segment, result: GenerationResult, turn: int) -> None:
    """What the scaffold records for one request (rlsys.rollout.scaffold)."""
    seg.fill_context_routes(result.prompt_routed_experts)
    seg.append_generation(result, turn=turn)
    seg.record_request_routes(
        result.versions[-1], result.prompt_routed_experts, list(result.superseded_routes)
    )


def _rollout(
    v0: Transformer, v1: Transformer, mid_request: bool
) -> tuple[Trajectory, GenerationResult]:
    core = EngineCore(
        v0.cfg, EngineConfig(max_context_tokens=256), LocalRunner(v0.cfg, v0.state_dict())
    )
    seg = Segment()
    seg.append(PROMPT, turn=-1, policy=False)
    first = _run(core, list(seg.token_ids), "t0")
    _append_turn(seg, first, 0)
    seg.append(OBSERVATION, turn=0, policy=False)
    if mid_request:  # the update lands while turn 1 is decoding
        second = _run(core, list(seg.token_ids), "t1", update_after=4, state=v1.state_dict())
        assert second.superseded_routes and {0, 1} <= set(second.versions)
    else:  # between the turns: turn 1 prefills the whole context again under v1
        core.update_weights(v1.state_dict(), 1)
        second = _run(core, list(seg.token_ids), "t1")
        assert set(second.versions) == {1}
    _append_turn(seg, second, 1)
    return Trajectory("r", "g", "t", [seg], reward=1.0), second


@pytest.mark.parametrize("mid_request", [False, True])
@pytest.mark.parametrize("tables", [True, False])
def test_each_version_replays_the_routes_it_used(mid_request: bool, tables: bool) -> None:
    v0 = tiny_model().eval()
    v1 = _moved(v0).eval()
    traj, second = _rollout(v0, v1, mid_request)
    versions = torch.tensor(
        [
            v
            for v, m in zip(traj.segments[0].versions, traj.segments[0].policy_mask, strict=True)
            if m
        ]
    )
    want = behaviour(traj)
    trainer = make_trainer(copy.deepcopy(v1), replay_experts="indices_and_gates")
    exact = []
    for version, weights in ((0, v0), (1, v1)):
        got = trainer.log_probs([traj], model=weights, version=version if tables else None)[0]
        at_v = versions == version
        assert at_v.any()
        exact.append(torch.equal(got[at_v], want[at_v]))
    # the rows turn 1 was conditioned on are replayed with the routes v1 computed for them
    used = second.prompt_routed_experts["indices"]
    rows = used.shape[1]
    packed = pack([(0, traj.segments[0], traj)], version=1 if tables else None)
    assert packed.routes is not None
    replayed_as_used = torch.equal(packed.routes.indices[:, :rows], used.to(torch.int64))
    if tables:
        assert all(exact) and replayed_as_used, exact
    else:  # one route per row: v1's tokens get v0's routes on rows v1 recomputed
        assert not replayed_as_used
        # Inside a request the tokens of one version are replayed with the other's routes
        # on their own rows: some move. Between turns only context rows carry the wrong
        # routes, and whether that moves a token of the tiny model in the last bit depends
        # on the CPU's kernels (it did on one 2-core box and not on another): not asserted.
        if mid_request:
            assert not all(exact), exact
