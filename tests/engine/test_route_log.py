"""`RouteLog.row` reads one row from the append holding it: the same values as a slice of
the merged log, a compact tensor of its own (what a result pickles), and no merge of the
log (which copied the whole log at every decode step)."""

from __future__ import annotations

import pickle

import torch

from rlsys.engine.route_log import RouteLog
from rlsys.model import RoutedExperts


def _routes(rows: int, seed: int) -> RoutedExperts:
    g = torch.Generator().manual_seed(seed)
    return RoutedExperts(
        torch.randint(0, 16, (3, rows, 2), generator=g), torch.rand(3, rows, 2, generator=g)
    )


def _log_of(parts: list[int]) -> RouteLog:
    log = RouteLog(n_experts=16)
    for i, rows in enumerate(parts):
        log.append(_routes(rows, i))
    return log


def test_row_matches_the_merged_log_across_appends_truncate_and_extend() -> None:
    log = _log_of([5, 1, 1, 3, 1])
    log.truncate(10)  # drops 1 row of the last append... of 11 rows
    prefix = _log_of([4, 2])
    log.extend(prefix, 3)
    reference = _log_of([5, 1, 1, 3, 1])
    reference.truncate(10)
    reference.extend(prefix, 3)
    merged = reference.slice(0, reference.rows)  # merges the reference log
    assert log.rows == reference.rows == 13
    for r in range(log.rows):
        got = log.row(r)
        assert set(got) == {"indices", "gates"}
        for key in got:
            assert torch.equal(got[key], merged[key][:, r]), (r, key)


def test_a_row_owns_its_storage_and_leaves_the_log_unmerged() -> None:
    log = _log_of([2048, 1, 1])
    parts = len(log._parts)
    row = log.row(log.rows - 1)
    assert len(log._parts) == parts  # no O(length) merge per token
    # a view would pickle the whole 2,048-row append along with the row
    assert len(pickle.dumps(row)) < 2_000
    assert torch.equal(log.row(5)["indices"], log.slice(5, 6)["indices"][:, 0])
