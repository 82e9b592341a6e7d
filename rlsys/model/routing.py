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
  size and are fine for indices-only replay, where gates are recomputed anyway.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

_ID_DTYPES = {"uint8": torch.uint8, "int16": torch.int16}
_GATE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class RoutedExperts:
    """Routes of T token rows through L MoE layers: ids (L, T, k) int64, gates (L, T, k) fp32."""

    indices: Tensor
    gates: Tensor

    @property
    def num_tokens(self) -> int:
        return self.indices.shape[1]

    def select(self, rows: Tensor | slice) -> RoutedExperts:
        """The routes of a subset of token rows (e.g. one sequence of a packed batch)."""
        return RoutedExperts(self.indices[:, rows], self.gates[:, rows])

    @staticmethod
    def cat(parts: list[RoutedExperts]) -> RoutedExperts:
        """Concatenate along tokens (e.g. a prefill record followed by decode steps)."""
        return RoutedExperts(
            torch.cat([p.indices for p in parts], dim=1), torch.cat([p.gates for p in parts], dim=1)
        )

    def to_compact(self, n_experts: int, gate_dtype: str = "float32") -> dict[str, Tensor]:
        """Compact tensors for transport: ids uint8/int16, gates in `gate_dtype`."""
        id_dtype = "uint8" if n_experts <= 256 else "int16"
        return {
            "indices": self.indices.to(_ID_DTYPES[id_dtype]).contiguous(),
            "gates": self.gates.to(_GATE_DTYPES[gate_dtype]).contiguous(),
        }

    @staticmethod
    def from_compact(data: dict[str, Tensor]) -> RoutedExperts:
        return RoutedExperts(data["indices"].to(torch.int64), data["gates"].to(torch.float32))


@dataclass
class RoutingRecorder:
    """Collects every MoE layer's routes during a forward (layers are added in order)."""

    _indices: list[Tensor] = field(default_factory=list)
    _gates: list[Tensor] = field(default_factory=list)

    def add(self, layer: int, indices: Tensor, gates: Tensor) -> None:
        assert layer == len(self._indices), "MoE layers must record in order"
        self._indices.append(indices.detach().to(torch.int64))
        self._gates.append(gates.detach().to(torch.float32))

    @property
    def layers(self) -> int:
        """MoE layers recorded so far (0 for a model without MoE layers)."""
        return len(self._indices)

    def routes(self) -> RoutedExperts:
        return RoutedExperts(torch.stack(self._indices), torch.stack(self._gates))


@dataclass
class RoutingReplay:
    """Routes to impose on a forward; rows must match the forward's packed token rows.

    `rows` (N,) bool, optional: replay only these rows (those with a recorded route, e.g.
    the rows that produced policy tokens); the others are routed by the current router.
    """

    routes: RoutedExperts
    use_gates: bool
    rows: Tensor | None = None

    def lookup(self, layer: int) -> tuple[Tensor, Tensor | None]:
        gates = self.routes.gates[layer] if self.use_gates else None
        return self.routes.indices[layer], gates


Routing = RoutingRecorder | RoutingReplay
