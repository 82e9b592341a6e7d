"""Packing trajectories into the trainer's tensors: one packed row per token, no padding.

Every segment of every trajectory becomes a span of rows in one flat token tensor (the
model's packed varlen forward). A policy token at segment position `i` is predicted by row
`i - 1` of its span (`pred_rows`); all per-policy-token data (targets, behaviour log-probs,
versions, candidate sets, returns) is laid out in that order, `P` long.

Routed-expert convention (shared with the engine): a token's recorded route is that of the
forward row that produced its distribution (row i - 1 of its span; a policy token's
`pred_row`). Policy tokens carry theirs; prompt and observation tokens carry the route the
engine used when a later request fed them (`Segment.fill_context_routes`). Rows with a
record are marked in `routed_rows`; the others are routed by the current router.

Sparse GQA selections (when the engine recorded them) travel with the routes, under the
same row convention; `routes.blocks` is (S, N, Hkv, W), -1 where a row has none.

Tensor legend: N packed rows, P policy tokens, C longest candidate set, L MoE layers,
k experts per token, S Sparse GQA layers, Hkv KV groups, W selected blocks (<= k / B).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np
import torch
from torch import Tensor

from rlsys.candidate_rows import candidate_arrays
from rlsys.kernels.host_to_device import moved_without_sync
from rlsys.model.routing import RoutedExperts
from rlsys.route_rows import route_runs
from rlsys.trajectory import Segment, Trajectory


@dataclass
class PackedBatch:
    tokens_N: Tensor  # int64 token ids
    spans: list[tuple[int, int]]  # (first row, length) of each segment
    pred_rows_P: Tensor  # int64 row whose logits predict each policy token
    targets_P: Tensor  # int64 the policy token
    behaviour_P: Tensor  # fp32 log-prob recorded by the engine
    versions_P: Tensor  # int64 policy version that sampled the token
    sample_P: Tensor  # int64 index of the token's trajectory in the step's list
    returns_P: Tensor  # fp32 outcome reward plus the penalty of the token's turn
    penalties_P: Tensor  # fp32 the penalty of the token's turn (0 if none)
    candidates_PC: Tensor  # int64 recorded top-p set, padded with -1 (C may be 0)
    has_candidates_P: Tensor  # bool: the token was sampled from a recorded set
    routes: RoutedExperts | None  # (L, N, k) for every row; meaningful where routed_rows
    routed_rows_N: Tensor  # bool: the row carries a recorded route

    @property
    def num_tokens(self) -> int:
        return int(self.tokens_N.numel())

    @property
    def num_policy_tokens(self) -> int:
        return int(self.targets_P.numel())

    def to(self, device: torch.device) -> PackedBatch:
        """The same batch with its tensors on `device` (packing always builds on CPU)."""
        if self.tokens_N.device == device:
            return self
        moved = {
            f.name: moved_without_sync(getattr(self, f.name), device)
            for f in fields(self)
            if isinstance(getattr(self, f.name), Tensor)
        }
        routes = self.routes.to(device) if self.routes is not None else None
        return replace(self, routes=routes, **moved)


def route_entry(entry: Any) -> tuple[Tensor, Tensor, Tensor | None]:
    """One token's routed-experts payload -> (ids (L, k) int64, gates (L, k) fp32, Sparse GQA
    selections (S, Hkv, W) int64 or None).

    Accepts the engine's compact per-token dict `{"indices": (L, k), "gates": (L, k)}` (and
    `"blocks"` when recorded; tensors or nested lists, ids possibly uint8/int16) or a
    one-token `RoutedExperts`.
    """
    if isinstance(entry, RoutedExperts):
        blocks = entry.blocks[:, 0] if entry.blocks is not None else None
        return entry.indices[:, 0].to(torch.int64), entry.gates[:, 0].to(torch.float32), blocks
    ids = torch.as_tensor(entry["indices"]).to(torch.int64)
    gates = (  # no gates sent (engine.route_gates: none): indices-only replay recomputes them
        torch.as_tensor(entry["gates"]).to(torch.float32)
        if "gates" in entry
        else torch.zeros(ids.shape)
    )
    blocks = torch.as_tensor(entry["blocks"]).to(torch.int64) if "blocks" in entry else None
    return ids.reshape(ids.shape[0], -1), gates.reshape(gates.shape[0], -1), blocks


def pack(
    items: Sequence[tuple[int, Segment, Trajectory]],
    *,
    with_routes: bool = True,
    version: int | None = None,
) -> PackedBatch:
    """Pack `(sample index, segment, its trajectory)` items into one `PackedBatch`.

    `version`: the forward runs under that policy version, so a segment's table of the
    routes that version computed (`Segment.version_table`) overrides its per-row routes."""
    tokens, spans = [], []
    cands: list[tuple[np.ndarray, np.ndarray]] = []  # per segment: its policy rows' sets
    columns: list[tuple[np.ndarray, ...]] = []  # per segment: the policy tokens' columns
    route_rows: list[tuple[int, Any]] = []
    route_blocks: list[tuple[int, dict[str, Any]]] = []
    overrides: list[tuple[int, dict[str, Any]]] = []
    row = 0
    for sample, seg, traj in items:
        spans.append((row, len(seg.token_ids)))
        tokens += seg.token_ids
        if with_routes:  # every recorded row, policy or context (R3 over all of them)
            route_blocks += [(row + start - 1, block) for start, block in seg.context_routes]
            for start, run in route_runs(seg.routed_experts):
                if isinstance(run, dict):  # an engine result's block: copied in one go
                    if start == 0:  # token 0 has no row before it in its span
                        run = {key: t[:, 1:] for key, t in run.items()}
                        start = 1
                    route_blocks.append((row + start - 1, run))
                    continue
                route_rows += [
                    (row + start + j - 1, entry)
                    for j, entry in enumerate(run)
                    if start + j and entry is not None
                ]
            table = seg.version_table(version) if version is not None else None
            if table is not None:
                overrides.append((row, table))
        # the policy tokens' columns, a segment at a time (a Python tuple per token cost
        # ~a fifth of packing two 8K-token sequences)
        at = np.flatnonzero(np.asarray(seg.policy_mask, dtype=bool))
        if at.size:
            assert at[0] > 0, "a segment starts with its prompt, never with a policy token"
            penalty = np.zeros(at.size)
            if traj.turn_penalties:
                turns = np.asarray(seg.turn_index, dtype=np.int64)[at]
                for turn, value in traj.turn_penalties.items():
                    penalty[turns == turn] = value
            columns.append(
                (
                    row + at - 1,
                    np.asarray(seg.token_ids, dtype=np.int64)[at],
                    np.asarray(seg.logprobs, dtype=np.float64)[at],
                    np.asarray(seg.versions, dtype=np.int64)[at],
                    np.full(at.size, sample, dtype=np.int64),
                    traj.reward + penalty,
                    penalty,
                )
            )
            cands.append(candidate_arrays(seg.candidate_ids, at))
        row += len(seg.token_ids)
    # seven columns, each the segments' parts in order (empty when no policy token)
    cols = [np.concatenate(c) for c in zip(*columns, strict=True)] or [np.zeros(0)] * 7
    cand_PC, has_cand_P = _candidates(cands)
    routes, routed = _routes(route_rows, route_blocks, row, overrides)
    return PackedBatch(
        tokens_N=torch.tensor(tokens, dtype=torch.int64),
        spans=spans,
        pred_rows_P=_column(cols[0], torch.int64),
        targets_P=_column(cols[1], torch.int64),
        behaviour_P=_column(cols[2], torch.float32),
        versions_P=_column(cols[3], torch.int64),
        sample_P=_column(cols[4], torch.int64),
        returns_P=_column(cols[5], torch.float32),
        penalties_P=_column(cols[6], torch.float32),
        candidates_PC=cand_PC,
        has_candidates_P=has_cand_P,
        routes=routes,
        routed_rows_N=routed,
    )


def _column(values: np.ndarray, dtype: torch.dtype) -> Tensor:
    """A packed column as a tensor of `dtype` (float64 values round once, to fp32)."""
    return torch.from_numpy(np.ascontiguousarray(values)).to(dtype)


def _candidates(cands: list[tuple[np.ndarray, np.ndarray]]) -> tuple[Tensor, Tensor]:
    """(P, C) candidate ids padded with -1, and which rows have a set, from each segment's
    (lengths, ids end to end) of its policy rows: one masked copy (a tensor op per row
    would cost ~tens of microseconds on a 16K-token batch each)."""
    lens = np.concatenate([c[0] for c in cands]) if cands else np.zeros(0, np.int64)
    flat = np.concatenate([c[1] for c in cands]) if cands else np.zeros(0, np.int64)
    width = int(lens.max()) if lens.size else 0
    cand_PC = np.full((lens.size, width), -1, dtype=np.int64)
    cand_PC[np.arange(width) < lens[:, None]] = flat  # row-major: each row's set in order
    return torch.from_numpy(cand_PC), torch.from_numpy(lens > 0)


def _stacked(entries: list[tuple[int, Any]]) -> tuple[Tensor, Tensor] | None:
    """Per-row engine entries whose ids (and gates) are tensors of one dtype and shape,
    stacked once: (L, n, k) int64 ids and fp32 gates; None when they are not all such."""
    first = entries[0][1]
    if not isinstance(first, dict) or not all(
        isinstance(e, dict)
        and isinstance(e.get("indices"), Tensor)
        and isinstance(e.get("gates"), Tensor)
        and "blocks" not in e
        for _, e in entries
    ):
        return None
    ids = [e["indices"] for _, e in entries]
    gates = [e["gates"] for _, e in entries]
    if any(t.dtype != ids[0].dtype or t.shape != ids[0].shape for t in ids) or any(
        t.dtype != gates[0].dtype or t.shape != ids[0].shape for t in gates
    ):
        return None
    layers = ids[0].shape[0]
    stacked = torch.stack(ids, 1).to(torch.int64).reshape(layers, len(ids), -1)
    return stacked, torch.stack(gates, 1).to(torch.float32).reshape(layers, len(ids), -1)


def _routes(
    route_rows: list[tuple[int, Any]],
    route_blocks: list[tuple[int, dict[str, Any]]],
    num_rows: int,
    overrides: list[tuple[int, dict[str, Any]]] = (),  # type: ignore[assignment]
) -> tuple[RoutedExperts | None, Tensor]:
    """(L, N, k) routes from per-row entries and (first row, block) context blocks; then
    the version tables (`overrides`) over both."""
    routed = torch.zeros(num_rows, dtype=torch.bool)
    stacked = _stacked(route_rows) if route_rows else None
    entries = [] if stacked is not None else [(r, route_entry(e)) for r, e in route_rows]
    if stacked is not None:
        layers, k = stacked[0].shape[0], stacked[0].shape[2]
    elif entries:
        layers, k = entries[0][1][0].shape
    elif route_blocks or overrides:
        layers, _, k = [*route_blocks, *overrides][0][1]["indices"].shape
    else:
        return None, routed
    ids = torch.zeros(layers, num_rows, k, dtype=torch.int64)
    gates = torch.zeros(layers, num_rows, k, dtype=torch.float32)
    _copy_route_blocks(route_blocks, ids, gates, routed)
    if stacked is not None:  # one indexed copy for every row
        at = torch.tensor([r for r, _ in route_rows], dtype=torch.int64)
        ids[:, at], gates[:, at] = stacked
        routed[at] = True
    for r, (row_ids, row_gates, _) in entries:
        ids[:, r], gates[:, r] = row_ids, row_gates
        routed[r] = True
    _copy_route_blocks(overrides, ids, gates, routed)
    selections = _blocks(entries, route_blocks, num_rows, overrides)
    return RoutedExperts(ids, gates, selections), routed


def _copy_route_blocks(
    blocks: Sequence[tuple[int, dict[str, Any]]], ids: Tensor, gates: Tensor, routed: Tensor
) -> None:
    """Write each (first row, block) of routes over rows first..first + n - 1 of `ids` and
    `gates` (a block without "gates" leaves those rows' gates as they were), in order, so a
    later block wins where two cover a row; mark the rows routed."""
    for r0, block in blocks:
        n = int(block["indices"].shape[1])
        ids[:, r0 : r0 + n] = torch.as_tensor(block["indices"]).to(torch.int64)
        if "gates" in block:
            gates[:, r0 : r0 + n] = torch.as_tensor(block["gates"]).to(torch.float32)
        routed[r0 : r0 + n] = True


def _blocks(
    entries: list[tuple[int, tuple[Tensor, Tensor, Tensor | None]]],
    route_blocks: list[tuple[int, dict[str, Any]]],
    num_rows: int,
    overrides: list[tuple[int, dict[str, Any]]],
) -> Tensor | None:
    """(S, N, Hkv, W) Sparse GQA selections, -1 padded, if every recorded row carries them
    (context blocks, then per-row entries, then the version tables over both)."""
    rows = [(r, b) for r, (_, _, b) in entries]
    every = [*route_blocks, *overrides]
    blocks = [(r0, torch.as_tensor(block["blocks"])) for r0, block in every if "blocks" in block]
    if any(b is None for _, b in rows) or len(blocks) < len(every):
        return None
    shapes = [b.shape for _, b in rows] + [b[:, 0].shape for _, b in blocks]
    if not shapes:
        return None
    layers, groups = shapes[0][0], shapes[0][1]
    width = max(shape[-1] for shape in shapes)
    out = torch.full((layers, num_rows, groups, width), -1, dtype=torch.int64)
    context, tables = blocks[: len(route_blocks)], blocks[len(route_blocks) :]
    for r0, b in context:
        out[:, r0 : r0 + b.shape[1], :, : b.shape[-1]] = b.to(torch.int64)
    for r, b in rows:
        out[:, r, :, : b.shape[-1]] = b  # type: ignore[union-attr]
    for r0, b in tables:
        out[:, r0 : r0 + b.shape[1]] = -1
        out[:, r0 : r0 + b.shape[1], :, : b.shape[-1]] = b.to(torch.int64)
    return out


def micro_batches(
    trajectories: Sequence[Trajectory], max_tokens: int
) -> list[list[tuple[int, Segment, Trajectory]]]:
    """Split all segments into groups of at most `max_tokens` rows (a longer segment is a
    group of its own); segments keep their trajectory order."""
    groups: list[list[tuple[int, Segment, Trajectory]]] = [[]]
    used = 0
    for sample, traj in enumerate(trajectories):
        for seg in traj.segments:
            if not any(seg.policy_mask):
                continue
            n = len(seg.token_ids)
            if groups[-1] and used + n > max_tokens:
                groups.append([])
                used = 0
            groups[-1].append((sample, seg, traj))
            used += n
    return [g for g in groups if g]
