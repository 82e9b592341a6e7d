"""`RouteRows`: a segment's per-token routes, an engine result's block kept as one run."""

from __future__ import annotations

import pickle

import pytest
import torch

from rlsys.engine.route_log import TokenRoutes
from rlsys.route_rows import RouteRows, route_runs
from rlsys.trajectory import Segment

pytestmark = pytest.mark.unit


def _block(n: int, layers: int = 3, k: int = 2, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "indices": torch.randint(0, 8, (layers, n, k), generator=g).to(torch.uint8),
        "gates": torch.rand(layers, n, k, generator=g),
    }


def test_reads_as_the_per_token_sequence_whichever_form_stores_it() -> None:
    block = _block(4)
    rows = RouteRows([None, None])
    rows += TokenRoutes(block)
    rows += [None, {"indices": 1}]
    cut = TokenRoutes(block)
    expected = [None, None, *(cut[j] for j in range(4)), None, {"indices": 1}]
    assert len(rows) == 8
    assert [type(run).__name__ for _, run in rows.runs()] == ["list", "dict", "list"]
    for got, want in zip(rows, expected, strict=True):
        if want is None or "gates" not in want:
            assert got == want
        else:
            assert all(torch.equal(got[key], want[key]) for key in want)
    assert torch.equal(rows[-3]["gates"], block["gates"][:, 3])
    assert rows[6:] == [None, {"indices": 1}] and rows.last_recorded() == 7
    with pytest.raises(IndexError):
        rows[8]


def test_last_recorded_sees_a_block_and_skips_trailing_nones() -> None:
    rows = RouteRows([None])
    assert rows.last_recorded() == -1
    rows += TokenRoutes(_block(3))
    rows += [None, None]
    assert rows.last_recorded() == 3


def test_pickles_as_its_runs_and_compares_with_a_list() -> None:
    rows = RouteRows([None, {"indices": 2}])
    again = pickle.loads(pickle.dumps(rows))
    assert again == [None, {"indices": 2}] and again == rows
    block = _block(200)
    blocked = RouteRows(TokenRoutes(block))
    per_token = RouteRows(list(TokenRoutes(block)))  # what segments stored before
    # one block pickles smaller than its 200 entries cut one by one
    assert len(pickle.dumps(blocked)) < len(pickle.dumps(per_token)) / 2


def test_a_generation_keeps_the_engines_block_and_an_old_segment_still_reads() -> None:
    class Result:
        token_ids, logprobs, versions, candidate_ids = [5, 6, 7], [-0.1] * 3, [0] * 3, []
        routed_experts = TokenRoutes(_block(3))

    seg = Segment()
    seg.append([1, 2], turn=-1, policy=False)
    seg.append_generation(Result(), turn=0)
    assert [(start, type(run).__name__) for start, run in seg.routed_experts.runs()] == [
        (0, "list"),
        (2, "dict"),
    ]
    assert seg.route_frontier() == 5
    old = Segment(token_ids=[1, 2, 3], routed_experts=[None, None, {"indices": 0}])
    assert isinstance(old.routed_experts, RouteRows) and old.route_frontier() == 3
    assert route_runs([None, 4]) == [(0, [None, 4])] and route_runs([]) == []
