"""The routed experts (and, when recorded, Sparse GQA selections) of one sequence's input
rows, in compact dtypes.

Row r holds the experts (every MoE layer) chosen for the token at position r when it was
fed to the model; its logits predicted token r + 1. So a result's per-token
`routed_experts[i]` is row `prompt_len - 1 + i` (the row that produced generated token i),
and `prompt_routed_experts` holds rows [0, prompt_len - 1): together they cover every input
row of `prompt + generated[:-1]`, exactly the rows of the trainer's forward over them.

Objects, not bytes, are what a long-lived engine must keep few of: every object the
collector tracks is walked again by each full collection, inside an engine step. A log
appends one small part per decode step, so it folds its newest `FOLD` parts into one
whenever that many have piled up at one level (`_push`): a sequence of n rows holds
O(FOLD log n) parts, each row copied once per level. A log's first fold may come early
(`phase`), so that sequences decoding side by side fold in different steps. A result's
per-token routes are one compact block (`TokenRoutes`), each token's entry cut from it on
demand, by the consumer.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC

import torch
from torch import Tensor

from rlsys.model import RoutedExperts
from rlsys.model.routing import cat_blocks


class RouteLog:
    """Append-only (until `clear`, or a `truncate` of the last append) compact routes: ids
    uint8/int16, gates in `gate_dtype` (fp32; bf16; "none": no gates, for indices-only replay)."""

    # parts folded into one when this many of one level are the newest (see module doc)
    FOLD = 32
    _WHOLE = 1 << 30  # the level of a part that never folds again (a merge of everything)

    def __init__(self, n_experts: int, gate_dtype: str = "float32", phase: int = 0) -> None:
        """`phase` in [0, FOLD): the log's first fold comes that many appends early. Logs of
        sequences that decode together append in the same steps; with their phases spread
        (the engine gives consecutive requests consecutive phases), each step folds
        ~1/FOLD of them instead of all of them every FOLD steps (a host stall of several ms
        at a batch of 256, once per FOLD steps)."""
        if not 0 <= phase < self.FOLD:
            raise ValueError(f"phase must be in [0, {self.FOLD}), got {phase}")
        self.n_experts, self.gate_dtype = n_experts, gate_dtype
        self._parts: list[dict[str, Tensor]] = []
        # the parts' levels as runs, oldest first: [level, parts]; a part appended is level
        # 0, a fold of FOLD level-l parts is level l + 1 (O(1) per append to keep)
        self._runs: list[list[int]] = []
        self.rows = 0
        self._phase = self._early = phase  # `_early`: level-0 parts the next fold lacks

    def append(self, routes: RoutedExperts) -> None:
        self.append_compact(routes.to_compact(self.n_experts, self.gate_dtype))

    def append_compact(self, part: dict[str, Tensor]) -> None:
        """Append rows already in this log's compact form (`RoutedExperts.to_compact` with
        this log's dtypes), e.g. one sequence's rows of a whole step's compact routes."""
        self._parts.append(part)
        self.rows += part["indices"].shape[1]
        self._push(0)

    def _push(self, level: int) -> None:
        """Count a new newest part of `level`; while the newest FOLD parts share a level
        (not `_WHOLE`), merge them into one part a level up."""
        runs = self._runs
        if runs and runs[-1][0] == level:
            runs[-1][1] += 1
        else:
            runs.append([level, 1])
        f = self.FOLD - self._early if level == 0 else self.FOLD
        if level != self._WHOLE and runs[-1][1] == f:
            merged = _merge(self._parts[-f:])
            del self._parts[-f:]
            self._parts.append(merged)
            runs.pop()
            if level == 0:
                self._early = 0
            self._push(level + 1)

    def extend(self, other: RouteLog, rows: int) -> None:
        """Take the first `rows` rows of `other` (a prefix-cache entry's log)."""
        if rows:
            self._parts.append(other.slice(0, rows))
            self.rows += rows
            self._push(self._WHOLE)

    def truncate(self, rows: int) -> None:
        """Drop rows >= `rows`, all of them from the last append (a verify's rejected drafts)."""
        drop = self.rows - rows
        if drop <= 0:
            return
        last = self._parts[-1]
        kept = last["indices"].shape[1] - drop
        assert kept >= 0, "only rows of the last append are ever dropped"
        self._parts[-1] = {key: t[:, :kept] for key, t in last.items()}
        self.rows = rows

    def clear(self) -> None:
        self._parts, self._runs, self.rows = [], [], 0
        self._early = self._phase

    def slice(self, start: int, stop: int) -> dict[str, Tensor]:
        """Rows [start, stop) as {"indices": (L, n, k), "gates": (L, n, k)}."""
        assert 0 <= start <= stop <= self.rows, (start, stop, self.rows)
        if len(self._parts) > 1:  # compact once so later slices are cheap
            self._parts, self._runs = [_merge(self._parts)], [[self._WHOLE, 1]]
        if not self._parts:
            raise ValueError("no routes recorded")
        return {key: t[:, start:stop].contiguous() for key, t in self._parts[0].items()}

    def row(self, r: int) -> dict[str, Tensor]:
        """One row as {"indices": (L, k), "gates": (L, k)} (a token's routed experts), and
        "blocks": (S, Hkv, W) when selections are recorded.

        Read from the part that holds it, without merging the log: merging (`slice`)
        copies the whole log, O(length) per read (when the engine read every sequence's
        newest row at every decode step, that dominated the host side of a batch-64 step
        on the GPU; a result's token routes now come from one `slice`, `token_routes`)."""
        assert 0 <= r < self.rows, (r, self.rows)
        if "blocks" in self._parts[0]:  # selection widths differ per append: pad via slice
            return {key: t[:, 0] for key, t in self.slice(r, r + 1).items()}
        end = self.rows
        for part in reversed(self._parts):  # the newest rows are asked for most often
            start = end - part["indices"].shape[1]
            if r >= start:
                return {key: t[:, r - start].clone() for key, t in part.items()}
            end = start
        raise AssertionError("rows are counted over the parts")


def _merge(parts: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Parts' rows in order, as one part (selection blocks: widths differ between steps, so
    they are padded to the widest)."""
    return {
        key: (cat_blocks if key == "blocks" else torch.cat)([p[key] for p in parts], dim=1)
        for key in parts[0]
    }


class TokenRoutes(SequenceABC):
    """A result's per-token routes as one compact block: {"indices": (L, n, k), "gates":
    (L, n, k)} (and "blocks": (S, n, Hkv, W)); entry j is token j's `{key: (L, k)}`, a
    copy cut on demand. The engine hands over one block per result instead of n small
    tensors, so it neither keeps n x 3 tracked objects alive while a request runs nor
    pays their copies inside its steps; it pickles as the block (a per-token view would
    pickle the block's whole storage, hence the copies)."""

    def __init__(self, block: dict[str, Tensor]) -> None:
        self.block = block

    def __len__(self) -> int:
        return int(self.block["indices"].shape[1]) if self.block else 0

    def __getitem__(self, j: int) -> dict[str, Tensor]:  # type: ignore[override]
        if not isinstance(j, int):
            raise TypeError(f"TokenRoutes takes an int index, got {type(j).__name__}")
        if not -len(self) <= j < len(self):
            raise IndexError(j)
        return {key: t[:, j].clone() for key, t in self.block.items()}


def token_routes(
    log: RouteLog,
    first: int,
    versions: list[int],
    superseded: list[tuple[int, dict[str, Tensor]]],
) -> TokenRoutes:
    """The routes of a result's len(versions) generated tokens: token j's input row is
    `first + j`. Rows the log holds come from it; a row a weight update cleared from the
    log before it was fed again (the request ended first) keeps the route its token was
    emitted with: the superseded version `versions[j]`'s."""
    n = len(versions)
    covered = max(0, min(n, log.rows - first))
    parts = [log.slice(first, first + covered)] if covered else []
    for j in range(covered, n):
        old = next((routes for v, routes in superseded if v == versions[j]), None)
        if old is None:
            raise AssertionError(f"no route recorded for token {j} (row {first + j})")
        parts.append({key: t[:, first + j : first + j + 1] for key, t in old.items()})
    return TokenRoutes(_merge(parts) if parts else {})
