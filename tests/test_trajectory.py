"""`Segment.append_generation`: an engine result recorded as a policy turn of a segment."""

from __future__ import annotations

import pytest

from rlsys.engine.api import GenerationResult
from rlsys.trajectory import Segment

pytestmark = pytest.mark.unit

PER_TOKEN = (
    "token_ids", "policy_mask", "logprobs", "versions", "turn_index", "candidate_ids",
    "routed_experts",
)  # fmt: skip


def per_token_lengths(seg: Segment) -> set[int]:
    return {len(getattr(seg, name)) for name in PER_TOKEN}


def test_a_result_becomes_the_policy_tokens_of_its_turn_with_their_records() -> None:
    seg = Segment()
    seg.append([1, 2, 3], turn=-1, policy=False)
    result = GenerationResult(
        "r",
        token_ids=[7, 8],
        logprobs=[-0.5, -1.5],
        versions=[3, 4],
        candidate_ids=[[7, 9], [8]],
        routed_experts=[{"indices": 1}, {"indices": 2}],
    )
    seg.append_generation(result, turn=0)
    assert seg.token_ids == [1, 2, 3, 7, 8]
    assert seg.policy_mask == [False] * 3 + [True] * 2
    assert seg.logprobs[3:] == [-0.5, -1.5] and seg.versions[3:] == [3, 4]
    assert seg.turn_index == [-1, -1, -1, 0, 0]
    assert seg.candidate_ids[3:] == [[7, 9], [8]]
    assert seg.routed_experts[3:] == [{"indices": 1}, {"indices": 2}]
    result.token_ids.append(9)  # the segment keeps its own lists
    assert len(seg.token_ids) == 5


def test_a_result_without_candidate_sets_or_routes_keeps_every_list_token_aligned() -> None:
    seg = Segment()
    seg.append([1], turn=-1, policy=False)
    seg.append_generation(GenerationResult("r", [5, 6], [-1.0, -2.0], [0, 0]), turn=0)
    assert per_token_lengths(seg) == {3}
    assert seg.candidate_ids == [None] * 3 and seg.routed_experts == [None] * 3
