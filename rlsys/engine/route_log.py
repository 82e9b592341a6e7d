"""The routed experts (and, when recorded, Sparse GQA selections) of one sequence's input
rows, in compact dtypes.

Row r holds the experts (every MoE layer) chosen for the token at position r when it was
fed to the model; its logits predicted token r + 1. So a result's per-token
`routed_experts[i]` is row `prompt_len - 1 + i` (the row that produced generated token i),
and `prompt_routed_experts` holds rows [0, prompt_len - 1): together they cover every input
row of `prompt + generated[:-1]`, exactly the rows of the trainer's forward over them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlsys.model import RoutedExperts
from rlsys.model.routing import cat_blocks


class RouteLog:
    """Append-only (until `clear`, or a `truncate` of the last append) compact routes: ids
    uint8/int16, gates in `gate_dtype` (fp32; bf16; "none": no gates, for indices-only replay)."""

    def __init__(self, n_experts: int, gate_dtype: str = "float32") -> None:
        self.n_experts, self.gate_dtype = n_experts, gate_dtype
        self._parts: list[dict[str, Tensor]] = []
        self.rows = 0

    def append(self, routes: RoutedExperts) -> None:
        self._parts.append(routes.to_compact(self.n_experts, self.gate_dtype))
        self.rows += routes.num_tokens

    def append_compact(self, part: dict[str, Tensor]) -> None:
        """Append rows already in this log's compact form (`RoutedExperts.to_compact` with
        this log's dtypes), e.g. one sequence's rows of a whole step's compact routes."""
        self._parts.append(part)
        self.rows += part["indices"].shape[1]

    def extend(self, other: RouteLog, rows: int) -> None:
        """Take the first `rows` rows of `other` (a prefix-cache entry's log)."""
        if rows:
            self._parts.append(other.slice(0, rows))
            self.rows += rows

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
        self._parts, self.rows = [], 0

    def slice(self, start: int, stop: int) -> dict[str, Tensor]:
        """Rows [start, stop) as {"indices": (L, n, k), "gates": (L, n, k)}."""
        assert 0 <= start <= stop <= self.rows, (start, stop, self.rows)
        if len(self._parts) > 1:  # compact once so later slices are cheap
            # blocks: widths differ between steps, so they are padded to the widest
            merged = {
                key: (cat_blocks if key == "blocks" else torch.cat)(
                    [p[key] for p in self._parts], dim=1
                )
                for key in self._parts[0]
            }
            self._parts = [merged]
        if not self._parts:
            raise ValueError("no routes recorded")
        return {key: t[:, start:stop].contiguous() for key, t in self._parts[0].items()}

    def row(self, r: int) -> dict[str, Tensor]:
        """One row as {"indices": (L, k), "gates": (L, k)} (a token's routed experts), and
        "blocks": (S, Hkv, W) when selections are recorded.

        Read from the append that holds it, without merging the log: the engine asks for
        the newest row of every sequence at every decode step, and merging (`slice`) would
        copy the whole log each time, O(length) per token (it dominated the host side of
        a batch-64 decode step on the GPU)."""
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
