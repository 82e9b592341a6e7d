"""A finished rollout as the trainer consumes it: token ids exactly as the engine saw them.

A trajectory is one or more segments. A segment is one context window: its tokens are the
prompt followed by alternating policy turns (sampled by the engine) and observations
(tool output, appended as ids). A compaction starts a new segment whose prompt is the
policy's own resumable summary. Every policy token carries its behaviour log-prob, policy
version, candidate set and routed experts; observation tokens carry none and are masked.

Routed experts (R3): `routed_experts[i]` is the route of the forward row that produced
token i's distribution (row i - 1). A policy token's comes with its generation; the rows of
prompt and observation tokens come with the next request's `prompt_routed_experts`
(`fill_context_routes`, kept as blocks in `context_routes`), so every row the policy
conditioned on carries the route the engine used. A token with neither has no record
(then the trainer's router decides). With `engine.record_selections` each route also holds
the row's Sparse GQA block selections ("blocks"), replayed the same way. A generation's
routes arrive as the engine's one block and stay one (`RouteRows`, `rlsys/route_rows.py`),
read per token; its candidate sets are kept as two arrays (`CandidateRows`,
`rlsys/candidate_rows.py`), read per token too.

One route per row is what the engine used for a row as first computed. A weight update
between two requests of a segment (or inside one) makes the engine compute earlier rows
again under the new version; the routes it used then are kept as version tables
(`version_routes`: rows 0..n-1 under one version), and a forward under version v replays
the last table of v over the per-row routes (`pack(..., version=v)`), so each token's
log-prob is reproduced under the routes its own version used.

Invariants: all per-token lists of a segment have the same length as `token_ids`;
`policy_mask[i]` is True exactly for engine-sampled tokens; a turn's penalty applies only to
the tokens of that turn (`turn_index[i] == turn`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from rlsys.candidate_rows import CandidateRows
from rlsys.route_rows import RouteRows, routes_block


class Generation(Protocol):
    """What a segment records of one engine result (`rlsys.engine.api.GenerationResult`)."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    candidate_ids: list[list[int]]  # empty when the engine recorded no candidate sets
    routed_experts: Any  # one entry per token, or None


@dataclass
class Segment:
    token_ids: list[int] = field(default_factory=list)
    policy_mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # 0.0 where not a policy token
    versions: list[int] = field(default_factory=list)  # -1 where not a policy token
    turn_index: list[int] = field(default_factory=list)  # -1 for the initial prompt
    # per token; None if not policy. Kept as arrays, not a list per token (`candidate_rows`)
    candidate_ids: CandidateRows = field(default_factory=CandidateRows)
    # per token; None if not policy. An engine result's block stays one block (`route_rows`)
    routed_experts: RouteRows = field(default_factory=RouteRows)
    # (first token index, {"indices": (L, n, k), "gates": (L, n, k)}): context-row routes;
    # "gates" absent with engine.route_gates none, "blocks" (S, n, Hkv, W) with selections
    context_routes: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    # (version, routes of rows 0..n-1 as that version computed them), in request order
    version_routes: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    last_request_version: int | None = None  # the policy version of the latest request

    def __post_init__(self) -> None:
        if not isinstance(self.routed_experts, RouteRows):
            self.routed_experts = RouteRows(self.routed_experts)
        if not isinstance(self.candidate_ids, CandidateRows):
            self.candidate_ids = CandidateRows(self.candidate_ids)

    def append(
        self,
        ids: list[int],
        *,
        turn: int,
        policy: bool,
        logprobs: list[float] | None = None,
        versions: list[int] | None = None,
        candidates: list[list[int]] | None = None,
        routed: Sequence[Any] | None = None,
    ) -> None:
        n = len(ids)
        self.token_ids += ids
        self.policy_mask += [policy] * n
        self.logprobs += logprobs if policy and logprobs is not None else [0.0] * n
        self.versions += versions if policy and versions is not None else [-1] * n
        self.turn_index += [turn] * n
        if policy and candidates is not None:
            self.candidate_ids.extend(candidates)
        else:
            self.candidate_ids.extend_none(n)
        self.routed_experts += routed if policy and routed is not None else [None] * n

    def append_generation(self, result: Generation, *, turn: int) -> None:
        """Append an engine result's tokens as the policy tokens of `turn`, each with its
        log-prob, version, candidate set and routed experts (None where the engine recorded
        none). The routes of the request's context rows are not part of this: see
        `fill_context_routes` and `record_request_routes`."""
        routed = result.routed_experts
        self.append(
            list(result.token_ids),
            turn=turn,
            policy=True,
            logprobs=list(result.logprobs),
            versions=list(result.versions),
            candidates=list(result.candidate_ids) or None,
            # the engine's block (`TokenRoutes`) stays one block; anything else, a copy
            routed=(
                None
                if routed is None
                else routed
                if routes_block(routed) is not None
                else list(routed)
            ),
        )

    def fill_context_routes(self, context_routes: Any) -> int:
        """Record the engine's routes of the context rows of a request whose prompt was
        this segment's first tokens (`{"indices": (L, n, k), "gates": (L, n, k)}`, rows
        0..n-1; row r predicted token r + 1) for the tokens past the last one that has a
        route: one block per request, not a record per row (a few bytes per token instead of
        a pickled pair of tensors each). Returns how many tokens it covered."""
        rows = min(int(context_routes["indices"].shape[1]), len(self.token_ids) - 1)
        start = self.route_frontier()
        if start > rows:
            return 0
        # every recorded kind: indices, gates, and Sparse GQA "blocks" when recorded
        block = {key: t[:, start - 1 : rows].clone() for key, t in context_routes.items()}
        self.context_routes.append((start, block))
        return rows - start + 1

    def record_request_routes(
        self, version: int | None, prompt_routes: Any, superseded: list[tuple[int, Any]]
    ) -> None:
        """Keep the version tables a request implies (see module doc): each superseded
        version's rows, and the request's own prompt rows when its version is not the
        previous request's (the engine recomputed the earlier rows under it)."""
        for old, block in superseded:
            self._add_version_table(old, block)
        changed = self.last_request_version is not None and version != self.last_request_version
        if version is not None and prompt_routes is not None and (changed or superseded):
            self._add_version_table(version, prompt_routes)
        if version is not None:
            self.last_request_version = version

    def _add_version_table(self, version: int, block: dict[str, Any]) -> None:
        rows = min(int(block["indices"].shape[1]), len(self.token_ids) - 1)
        if rows > 0:
            self.version_routes.append(
                (version, {k: t[:, :rows].clone() for k, t in block.items()})
            )

    def version_table(self, version: int) -> dict[str, Any] | None:
        """The last table of `version` (rows 0..n-1), if a weight update made one."""
        return next((b for v, b in reversed(self.version_routes) if v == version), None)

    def route_frontier(self) -> int:
        """The first token index (>= 1) after the last token that has a recorded route."""
        rows = self.routed_experts
        if isinstance(rows, RouteRows):
            last = max(rows.last_recorded(), 0)
        else:  # a segment pickled before `RouteRows`
            last = max((i for i, e in enumerate(rows) if e is not None), default=0)
        for start, block in self.context_routes:
            last = max(last, start + int(block["indices"].shape[1]) - 1)
        return last + 1


@dataclass
class Trajectory:
    rollout_id: str
    group_id: str
    task_id: str
    segments: list[Segment] = field(default_factory=list)
    reward: float = 0.0
    turn_penalties: dict[int, float] = field(default_factory=dict)  # turn -> penalty (<= 0)
    num_turns: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def num_policy_tokens(self) -> int:
        return sum(sum(s.policy_mask) for s in self.segments)

    @property
    def min_version(self) -> int:
        versions = [
            v for s in self.segments for v, m in zip(s.versions, s.policy_mask, strict=True) if m
        ]
        return min(versions) if versions else -1
