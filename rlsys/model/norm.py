"""Zero-centred RMSNorm with an fp32 scale.

`y = x / rms(x) * (1 + gamma)`. Invariant: gamma is stored and applied in fp32 whatever
dtype the rest of the model is cast to. Why: a channel carrying a massive activation learns
gamma close to -1; bf16 cannot represent values near -1 finely (spacing 2^-8 just above it),
so small updates snap gamma to exactly -1, masking the channel, and the next perturbation
reopens it: the output oscillates. In fp32 the same updates move (1 + gamma) smoothly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from rlsys import kernels


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm over the last dim; output fp32. `gamma_dtype` exists to show the bf16 failure."""

    def __init__(self, dim: int, eps: float, gamma_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.gamma_dtype = gamma_dtype
        self.gamma = nn.Parameter(torch.zeros(dim, dtype=gamma_dtype))

    def forward(self, x: Tensor) -> Tensor:
        return kernels.rms_norm(x, self.gamma, self.eps)

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> nn.Module:  # type: ignore[override]
        # `model.to(torch.bfloat16)` must not round gamma: restore its storage dtype after
        # any cast (device moves go through untouched).
        super()._apply(fn, recurse)
        if self.gamma.dtype != self.gamma_dtype:
            self.gamma.data = self.gamma.data.to(self.gamma_dtype)
        return self
