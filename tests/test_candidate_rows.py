"""A segment's candidate sets kept as two arrays (`rlsys.candidate_rows`): they read per
token as appended, pickle as arrays, and `pack` gathers the policy rows' sets from them as
it did from the per-token lists a segment pickled before."""

from __future__ import annotations

import pickle
import random

import numpy as np
import pytest
import torch

from rlsys.candidate_rows import CandidateRows, candidate_arrays
from rlsys.trainer.batch import pack
from rlsys.trajectory import Segment, Trajectory

pytestmark = pytest.mark.unit


def _sets(rng: random.Random, n: int, vocab: int = 320) -> list[list[int]]:
    # some capped ([]), most a handful of ids, a few wide
    return [rng.sample(range(vocab), rng.choice([0, 1, 2, 5, 16, 64])) for _ in range(n)]


def test_entries_read_back_as_appended() -> None:
    rows = CandidateRows([[3, 1], None])
    rows.extend_none(2)
    rows += [[], [7]]
    want = [[3, 1], None, None, None, [], [7]]
    assert len(rows) == 6 and list(rows) == want and rows == want
    assert rows[-1] == [7] and rows[1:4] == [None, None, None] and rows[4] == []
    with pytest.raises(IndexError):
        rows[6]
    rows.extend([[40_000, 2]])  # past int16: that chunk keeps int32
    assert rows[6] == [40_000, 2] and rows.arrays()[1].dtype == np.int32


def test_a_segment_pickles_its_sets_as_two_arrays() -> None:
    sets = _sets(random.Random(0), 500)
    seg = Segment()
    seg.append([1, 2, 3], turn=-1, policy=False)
    seg.append(list(range(500)), turn=0, policy=True, candidates=sets)
    state = seg.candidate_ids.__getstate__()
    assert set(state) == {"lengths", "flat"} and state["flat"].dtype == np.int16
    assert state["flat"].size == sum(len(s) for s in sets)
    back = pickle.loads(pickle.dumps(seg))
    assert isinstance(back.candidate_ids, CandidateRows)
    assert back.candidate_ids == [None] * 3 + sets
    # a segment built from lists (as tests and older code build them) converts on creation
    assert Segment(candidate_ids=[[7, 9], None]).candidate_ids == [[7, 9], None]


def test_the_gather_matches_reading_row_by_row() -> None:
    rng = random.Random(1)
    entries = [None if rng.random() < 0.3 else s for s in _sets(rng, 300)]
    rows = CandidateRows(entries)
    for at in (np.arange(0), np.arange(300), np.sort(rng.sample(range(300), 77))):
        lengths, flat = candidate_arrays(rows, at)
        want = [entries[i] or [] for i in at.tolist()]
        assert lengths.tolist() == [len(w) for w in want]
        assert flat.tolist() == [x for w in want for x in w]
        # a segment pickled before segments kept CandidateRows holds a plain list
        old_l, old_f = candidate_arrays(entries, at)
        assert np.array_equal(old_l, lengths) and np.array_equal(old_f, flat)


def test_pack_pads_each_policy_rows_set() -> None:
    rng = random.Random(2)
    segs, want = [], []
    for n in (40, 9):
        sets = _sets(rng, n)
        seg = Segment()
        seg.append([5] * 4, turn=-1, policy=False)
        seg.append([6] * n, turn=0, policy=True, logprobs=[-1.0] * n, versions=[0] * n,
                   candidates=sets)  # fmt: skip
        seg.append([7] * 3, turn=0, policy=False)
        segs.append(seg)
        want += sets
    trajs = [Trajectory(f"r{i}", "g", "t", [s], reward=1.0) for i, s in enumerate(segs)]
    batch = pack([(i, s, t) for i, t in enumerate(trajs) for s in t.segments])
    width = max(len(s) for s in want)
    expect = torch.full((len(want), width), -1, dtype=torch.int64)
    for r, s in enumerate(want):
        expect[r, : len(s)] = torch.tensor(s, dtype=torch.int64)
    assert torch.equal(batch.candidates_PC, expect)
    assert batch.has_candidates_P.tolist() == [len(s) > 0 for s in want]
