"""`RouteLog.row` reads one row from the append holding it: the same values as a slice of
the merged log, a compact tensor of its own (what a result pickles), and no merge of the
log (which copied the whole log at every decode step)."""

from __future__ import annotations

import pickle

import pytest
import torch

from rlsys.engine.route_log import RouteLog, token_routes
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


def test_one_row_appends_fold_into_few_parts_with_the_same_rows() -> None:
    """A decode step appends one row per sequence: 2,000 appends end in O(FOLD log n)
    parts, not 2,000 (each a dict of two tensors a full collection walks), and every row,
    slice and a truncate of the newest append read the same as the appended rows."""
    n = 2000
    log = RouteLog(n_experts=16)
    appended = [_routes(1, i) for i in range(n)]
    for routes in appended:
        log.append(routes)
        assert len(log._parts) <= 64  # FOLD 32: < 32 parts per level, 3 levels at 2,000
    want = torch.cat([r.indices for r in appended], dim=1).to(torch.uint8)
    for r in (0, 1, 31, 32, 1023, 1024, n - 1):
        assert torch.equal(log.row(r)["indices"], want[:, r]), r
    log.append(_routes(3, n))
    log.truncate(n + 1)  # a verify's rejected drafts: two of the newest append's rows
    assert log.rows == n + 1
    assert torch.equal(log.slice(0, n)["indices"], want)
    assert torch.equal(log.row(n)["indices"], _routes(3, n).indices[:, 0].to(torch.uint8))


def test_token_routes_cut_copies_and_take_superseded_rows_by_version() -> None:
    """A result's token routes: entry j is row first + j of the log, a copy (it pickles
    small); rows the log no longer holds (cleared by a weight update) come from the
    superseded version their token was emitted with."""
    log = _log_of([6, 1, 1])
    old = _log_of([9]).slice(0, 9)
    tokens = token_routes(log, 3, [1, 1, 1, 1, 0, 0], [(0, old)])
    assert len(tokens) == 6
    merged = log.slice(0, log.rows)
    for j in range(5):  # rows 3..7: the log's
        assert torch.equal(tokens[j]["gates"], merged["gates"][:, 3 + j])
    assert torch.equal(tokens[5]["indices"], old["indices"][:, 8])  # row 8: version 0's
    assert len(pickle.dumps(tokens[0])) < 2_000
    assert len(token_routes(RouteLog(16), 0, [], [])) == 0


def test_logs_of_side_by_side_sequences_fold_in_different_steps() -> None:
    """Sequences that decode together append to their logs in the same steps; with their
    phases spread (as the engine gives them), a step folds a few logs, not every log once
    per FOLD steps (a multi-ms host stall at a batch of 256), and the rows stay the same."""
    fold, n = RouteLog.FOLD, 64
    logs = [RouteLog(n_experts=16, phase=i % fold) for i in range(n)]
    appended = [_routes(1, step) for step in range(3 * fold)]
    most = 0
    for routes in appended:
        before = [len(log._parts) for log in logs]
        for log in logs:
            log.append(routes)
        most = max(most, sum(len(log._parts) <= b for log, b in zip(logs, before, strict=True)))
    assert most <= 2 * n // fold, most  # all n at once without phases
    want = torch.cat([r.indices for r in appended], dim=1).to(torch.uint8)
    for log in (logs[0], logs[1], logs[fold - 1]):
        assert torch.equal(log.slice(0, log.rows)["indices"], want)
        log.clear()  # a weight update: the phase holds for the rows that follow
        assert log._early == log._phase
    with pytest.raises(ValueError, match="phase"):
        RouteLog(n_experts=16, phase=fold)
