"""Packing a segment whose generations kept the engine's route blocks gives bitwise the batch
packed from the same routes cut into per-token entries (what segments stored before
`RouteRows`): ids, gates, Sparse GQA selections, and which rows are routed."""

from __future__ import annotations

import copy
from dataclasses import fields

import pytest
import torch

from rlsys.route_rows import RouteRows
from rlsys.trainer.batch import micro_batches, pack
from rlsys.trajectory import Trajectory
from tests.trainer.helpers import engine_trajectories, tiny_model

pytestmark = pytest.mark.unit


def _per_token(trajs: list[Trajectory]) -> list[Trajectory]:
    cut = copy.deepcopy(trajs)
    for traj in cut:
        for seg in traj.segments:
            seg.routed_experts = RouteRows(list(seg.routed_experts))
    return cut


@pytest.mark.parametrize(
    "options",
    [{}, {"record_selections": True}, {"route_gates": "none"}, {"context_routes": False}],
    ids=["gates", "selections", "ids-only", "no-context"],
)
def test_blocks_pack_bitwise_as_per_token_entries(options: dict) -> None:
    model = tiny_model()
    trajs = engine_trajectories(model, groups=1, **options)
    blocks = [run for t in trajs for s in t.segments for _, run in s.routed_experts.runs()]
    assert any(isinstance(run, dict) for run in blocks)  # the engine's blocks were kept
    cut = _per_token(trajs)
    assert not any(
        isinstance(run, dict) for t in cut for s in t.segments for _, run in s.routed_experts.runs()
    )
    for a_items, b_items in zip(micro_batches(trajs, 64), micro_batches(cut, 64), strict=True):
        a, b = pack(a_items, version=0), pack(b_items, version=0)
        for f in fields(a):
            x, y = getattr(a, f.name), getattr(b, f.name)
            if isinstance(x, torch.Tensor):
                assert x.dtype == y.dtype and torch.equal(x, y), f.name
        assert a.spans == b.spans and a.routed_rows_N.any()
        assert torch.equal(a.routes.indices, b.routes.indices)
        assert torch.equal(a.routes.gates, b.routes.gates)
        if options.get("record_selections"):
            assert torch.equal(a.routes.blocks, b.routes.blocks)
        else:
            assert a.routes.blocks is None and b.routes.blocks is None
