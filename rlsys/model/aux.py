"""Collector for auxiliary losses and counters produced inside one forward pass.

Passed explicitly down the model (no module globals); layers `add` scalar tensors, the
trainer reads `total()` or the per-name sums. Invariant: values keep their autograd graph.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class AuxLosses:
    """Named scalar losses summed over layers; `weights` scale them in `total()`."""

    weights: dict[str, float] = field(default_factory=dict)
    values: dict[str, Tensor] = field(default_factory=dict)

    def add(self, name: str, value: Tensor) -> None:
        self.values[name] = self.values[name] + value if name in self.values else value

    def total(self) -> Tensor:
        """Weighted sum of every collected loss (0 when nothing was collected)."""
        out = torch.zeros(())
        for name, value in self.values.items():
            out = out + self.weights.get(name, 1.0) * value
        return out
