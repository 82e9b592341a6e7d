"""Fine-grained gradient clamp on the residual stream.

Identity in the forward. In the backward, of the N gradient vectors (one per token row) that
reach a block's output, the `floor(f * N)` with the largest norm are scaled down to the norm
of the largest vector left untouched; `clipped`/`seen` count them. Why: in deep stacks rare
spikes start in middle layers and grow over a few layers; they are sparse, so clipping a
tiny top fraction per layer removes them without biasing the bulk of the gradient.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor, nn


def _clamp_top_fraction(fraction: float, counters: Tensor, grad: Tensor) -> Tensor:
    """The gradient reaching a block's output with its top `fraction` of row vectors (by
    norm) scaled to the norm of the largest row left untouched; counts into `counters`."""
    flat = grad.reshape(-1, grad.shape[-1])
    n = flat.shape[0]
    n_clip = min(int(fraction * n), n - 1)
    counters[1] += n
    if n_clip <= 0:
        return grad
    norms = flat.float().norm(dim=-1)
    top = norms.topk(n_clip + 1)
    threshold, idx = top.values[-1], top.indices[:n_clip]
    scale = (threshold / norms[idx].clamp_min(1e-30)).to(flat.dtype)
    flat = flat.clone()
    flat[idx] = flat[idx] * scale[:, None]
    counters[0] += n_clip
    return flat.view_as(grad)


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
        # A hook on the output itself, not an autograd Function returning `h.view_as(h)`:
        # the block's output stays the tensor it computed (FSDP2 warns on every forward of
        # a unit that returns a view, since an in-place op on it would skip its hooks), and
        # the hook sees the output's whole gradient, as the Function's backward did.
        h.register_hook(functools.partial(_clamp_top_fraction, self.fraction, self.counters))
        return h
