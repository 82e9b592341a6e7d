"""Routing record and replay, passed explicitly into a forward (no module globals).

- `RoutingRecorder`: each MoE layer adds its chosen expert ids (T, k) and gates (T, k) for
  the rows of this forward; `routes()` returns a `RoutedExperts` (layer-major).
- `RoutingReplay`: a forward takes ids from a `RoutedExperts` instead of its router.
  `use_gates=False` (indices only): the gates are recomputed from the current router, which
  keeps its gradient. `use_gates=True`: the recorded gates are used as given, so a replay on
  the same weights reproduces the recorded forward bitwise.
- Serialised form (`to_compact` / `from_compact`), what the engine sends per token:
  expert ids as uint8 (n_experts <= 256) or int16, gates as fp32. Why fp32: the bitwise
  replay path needs the exact gate values; bf16 gates (`gate_dtype="bfloat16"`) halve the
  size and are fine for indices-only replay, where gates are recomputed anyway; `"none"`
  sends no gates at all (indices-only replay recomputes them: `engine.route_gates`).
- Sparse GQA block selections (optional, `blocks`): per Sparse GQA layer, token row and KV
  group, the ids of the past blocks the indexer selected, ascending, padded with -1 to the
  record's width W <= k / B (W is the largest count in the record: a row at position p
  selects min(k / B, p // B) blocks, so short contexts cost less than k / B ids). Compact
  form int16 (int32 past 32,767 blocks). A replay with `blocks=True` imposes them on the
  Sparse GQA layers (`rlsys.model.sparse_gqa`), rows as for the experts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from rlsys.kernels.host_to_device import moved_without_sync

_ID_DTYPES = {"uint8": torch.uint8, "int16": torch.int16}
_GATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pad_blocks(blocks: Tensor, width: int) -> Tensor:
    """Selections (..., W) padded with -1 to `width` ids."""
    pad = width - blocks.shape[-1]
    return torch.nn.functional.pad(blocks, (0, pad), value=-1) if pad > 0 else blocks


def cat_blocks(parts: list[Tensor], dim: int) -> Tensor:
    """Concatenate selection records (S, n, Hkv, W_i) along rows, padding to the widest."""
    width = max(p.shape[-1] for p in parts)
    dtype = max((p.dtype for p in parts), key=lambda d: torch.iinfo(d).bits)
    return torch.cat([pad_blocks(p.to(dtype), width) for p in parts], dim=dim)


def compact_blocks(blocks: Tensor) -> Tensor:
    """int16 block ids (int32 when an id does not fit), -1 padding kept."""
    fits = blocks.numel() == 0 or int(blocks.max()) <= torch.iinfo(torch.int16).max
    return blocks.to(torch.int16 if fits else torch.int32).contiguous()


@dataclass
class RoutedExperts:
    """Routes of T token rows through L MoE layers: ids (L, T, k) int64, gates (L, T, k) fp32;
    optionally the Sparse GQA selections `blocks` (S, T, Hkv, W) int64, -1 padded."""

    indices: Tensor
    gates: Tensor
    blocks: Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.indices.shape[1]

    def select(self, rows: Tensor | slice) -> RoutedExperts:
        """The routes of a subset of token rows (e.g. one sequence of a packed batch)."""
        blocks = self.blocks[:, rows] if self.blocks is not None else None
        return RoutedExperts(self.indices[:, rows], self.gates[:, rows], blocks)

    def to(self, device: torch.device | str) -> RoutedExperts:
        """On `device`; from the host without a sync (pinned, asynchronous copies)."""
        blocks = moved_without_sync(self.blocks, device) if self.blocks is not None else None
        return RoutedExperts(
            moved_without_sync(self.indices, device), moved_without_sync(self.gates, device), blocks
        )

    @staticmethod
    def cat(parts: list[RoutedExperts]) -> RoutedExperts:
        """Concatenate along tokens (e.g. a prefill record followed by decode steps)."""
        blocks = [p.blocks for p in parts if p.blocks is not None]
        assert not blocks or len(blocks) == len(parts), "all parts or none carry selections"
        return RoutedExperts(
            torch.cat([p.indices for p in parts], dim=1),
            torch.cat([p.gates for p in parts], dim=1),
            cat_blocks(blocks, dim=1) if blocks else None,
        )

    def to_compact(self, n_experts: int, gate_dtype: str = "float32") -> dict[str, Tensor]:
        """Compact tensors for transport: ids uint8/int16, gates in `gate_dtype`, blocks
        int16 (when recorded)."""
        id_dtype = "uint8" if n_experts <= 256 else "int16"
        out = {"indices": self.indices.to(_ID_DTYPES[id_dtype]).contiguous()}
        if gate_dtype != "none":
            out["gates"] = self.gates.to(_GATE_DTYPES[gate_dtype]).contiguous()
        if self.blocks is not None:
            out["blocks"] = compact_blocks(self.blocks)
        return out

    @staticmethod
    def from_compact(data: dict[str, Tensor]) -> RoutedExperts:
        blocks = data.get("blocks")
        indices = data["indices"].to(torch.int64)
        gates = data.get("gates")
        return RoutedExperts(
            indices,
            gates.to(torch.float32) if gates is not None else torch.zeros(indices.shape),
            blocks.to(torch.int64) if blocks is not None else None,
        )


@dataclass
class RoutingRecorder:
    """Collects every MoE layer's routes during a forward (layers are added in order), and
    with `blocks=True` every Sparse GQA layer's block selections."""

    blocks: bool = False
    _indices: list[Tensor] = field(default_factory=list)
    _gates: list[Tensor] = field(default_factory=list)
    _blocks: list[Tensor] = field(default_factory=list)

    def add(self, layer: int, indices: Tensor, gates: Tensor) -> None:
        assert layer == len(self._indices), "MoE layers must record in order"
        self._indices.append(indices.detach().to(torch.int64))
        self._gates.append(gates.detach().to(torch.float32))

    @property
    def layers(self) -> int:
        """MoE layers recorded so far (0 for a model without MoE layers)."""
        return len(self._indices)

    def add_blocks(self, sparse_layer: int, blocks: Tensor) -> None:
        """Selections (N, Hkv, W) of one Sparse GQA layer for the forward's rows."""
        assert sparse_layer == len(self._blocks), "Sparse GQA layers must record in order"
        self._blocks.append(blocks.detach().to(torch.int64))

    def routes(self) -> RoutedExperts:
        blocks = cat_blocks([b.unsqueeze(0) for b in self._blocks], 0) if self._blocks else None
        return RoutedExperts(torch.stack(self._indices), torch.stack(self._gates), blocks)


@dataclass
class RoutingReplay:
    """Routes to impose on a forward; rows must match the forward's packed token rows.

    `rows` (N,) bool, optional: replay only these rows (those with a recorded route, e.g.
    the rows that produced policy tokens); the others are routed by the current router.
    `blocks`: also impose the recorded Sparse GQA selections (the routes must carry them).
    `experts=False` leaves the experts to the router (selections only).
    """

    routes: RoutedExperts
    use_gates: bool
    rows: Tensor | None = None
    blocks: bool = False
    experts: bool = True

    def lookup(self, layer: int) -> tuple[Tensor, Tensor | None]:
        gates = self.routes.gates[layer] if self.use_gates else None
        return self.routes.indices[layer], gates

    def lookup_blocks(self, sparse_layer: int) -> Tensor | None:
        """Recorded selections (N, Hkv, W) of one Sparse GQA layer, or None (not replayed)."""
        if not self.blocks:
            return None
        assert self.routes.blocks is not None, "selection replay needs recorded selections"
        return self.routes.blocks[sparse_layer]


Routing = RoutingRecorder | RoutingReplay
