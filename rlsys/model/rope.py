"""Rotary position embedding, computed from absolute positions (no precomputed table).

Invariant: the rotation of a position is computed elementwise from that position alone,
so a token gets the same q/k in prefill and in decode. On the Triton path (CUDA) one kernel
does it (`kernels/triton_ops/rope.py`); its backward is the inverse rotation.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlsys.kernels.dispatch import use_triton


class _TritonRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, positions: Tensor, inv_freq: Tensor) -> Tensor:  # type: ignore[no-untyped-def]
        from rlsys.kernels.triton_ops.rope import rope_fwd

        # the inverse rotation's table, made with the forward's (`_NEGATED`): negating it
        # here was one launch per backward
        ctx.save_for_backward(positions, _NEGATED[id(inv_freq)])
        # the kernel reads (row, head) strides: q and k, column slices of the fused
        # projection, are read in place (a copy each otherwise)
        return rope_fwd(x if x.stride(-1) == 1 else x.contiguous(), positions, inv_freq)

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[no-untyped-def]
        from rlsys.kernels.triton_ops.rope import rope_fwd

        positions, neg_inv_freq = ctx.saved_tensors
        return rope_fwd(g.contiguous(), positions, neg_inv_freq), None, None  # rotate back


_INV_FREQ: dict[tuple[int, float, torch.device], Tensor] = {}
# id(table) -> -table, made with each table of `_INV_FREQ` (which keeps them all alive, so
# an id names one table); negation is exact: the same bits as negating at every backward
_NEGATED: dict[int, Tensor] = {}


def inv_freq(d: int, theta: float, device: torch.device) -> Tensor:
    """`theta ** (-arange(0, d, 2) / d)` (D/2,) fp32, computed once per (d, theta, device).

    Why cached: computing it is four launches per call (two calls per attention layer);
    a decode step captured as a CUDA graph also needs it to exist before the capture,
    which the engine's eager warm-up forward guarantees. The values are those of the
    same torch expression on that device, whichever call computed them."""
    key = (d, float(theta), device)
    table = _INV_FREQ.get(key)
    if table is None:
        with torch.inference_mode(False), torch.no_grad():
            table = theta ** (-torch.arange(0, d, 2, dtype=torch.float32, device=device) / d)
            _NEGATED[id(table)] = -table
        _INV_FREQ[key] = table
    return table


def apply_rope(x: Tensor, positions: Tensor, theta: float) -> Tensor:
    """Rotate x (N, H, D) by positions (N,) (rotate-half convention); returns x's dtype."""
    d = x.shape[-1]
    inv_freq_h = inv_freq(d, theta, x.device)
    if use_triton(x):
        return _TritonRope.apply(x, positions, inv_freq_h)
    angles = positions.to(torch.float32)[:, None] * inv_freq_h[None, :]  # (N, D/2)
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x32 = x.float()
    x1, x2 = x32[..., : d // 2], x32[..., d // 2 :]
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x.dtype)
