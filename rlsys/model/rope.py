"""Rotary position embedding, computed from absolute positions (no precomputed table).

Invariant: the rotation of a position is computed elementwise from that position alone,
so a token gets the same q/k in prefill and in decode.
"""

from __future__ import annotations

import torch
from torch import Tensor


def apply_rope(x: Tensor, positions: Tensor, theta: float) -> Tensor:
    """Rotate x (N, H, D) by positions (N,) (rotate-half convention); returns x's dtype."""
    d = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d)
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # (N, D/2)
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x32 = x.float()
    x1, x2 = x32[..., : d // 2], x32[..., d // 2 :]
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x.dtype)
