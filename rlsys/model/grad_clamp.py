"""Fine-grained gradient clamp on the residual stream.

Identity in the forward. In the backward, of the N gradient vectors (one per token row) that
reach a block's output, the `floor(f * N)` with the largest norm are scaled down to the norm
of the largest vector left untouched; `clipped`/`seen` count them. Why: in deep stacks rare
spikes start in middle layers and grow over a few layers; they are sparse, so clipping a
tiny top fraction per layer removes them without biasing the bulk of the gradient.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn


class _ClampTopFraction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, h: Tensor, fraction: float, counters: Tensor) -> Tensor:
        ctx.fraction, ctx.counters = fraction, counters
        return h.view_as(h)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        flat = grad.reshape(-1, grad.shape[-1])
        n = flat.shape[0]
        n_clip = min(int(ctx.fraction * n), n - 1)
        ctx.counters[1] += n
        if n_clip <= 0:
            return grad, None, None
        norms = flat.float().norm(dim=-1)
        top = norms.topk(n_clip + 1)
        threshold, idx = top.values[-1], top.indices[:n_clip]
        scale = (threshold / norms[idx].clamp_min(1e-30)).to(flat.dtype)
        flat = flat.clone()
        flat[idx] = flat[idx] * scale[:, None]
        ctx.counters[0] += n_clip
        return flat.view_as(grad), None, None


class GradClamp(nn.Module):
    """Apply after a block; `clipped` and `seen` count gradient vectors since the reset."""

    def __init__(self, fraction: float) -> None:
        super().__init__()
        self.fraction = fraction
        self.register_buffer("counters", torch.zeros(2, dtype=torch.int64), persistent=False)

    @property
    def clipped(self) -> int:
        return int(self.counters[0])

    @property
    def seen(self) -> int:
        return int(self.counters[1])

    def reset(self) -> None:
        self.counters.zero_()

    def forward(self, h: Tensor) -> Tensor:
        if not (torch.is_grad_enabled() and h.requires_grad):
            return h
        return _ClampTopFraction.apply(h, self.fraction, self.counters)
