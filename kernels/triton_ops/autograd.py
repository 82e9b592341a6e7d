"""`torch.autograd.Function` wrappers: Triton forward (batch-invariant), torch backward.

Each wrapper's forward is the batch-invariant kernel; its backward is the plain math of
the same function in torch (grad of x @ w.T is g @ w and g.T @ x, ...), because only the
forward value must agree between engine and trainer. Attention's backward is the Triton
backward (`attention_bwd`): dense torch would need the L x L matrix.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from rlsys.kernels.triton_ops import linear as lin
from rlsys.kernels.triton_ops import rows


class Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor) -> Tensor:
        ctx.save_for_backward(x, w)
        return lin.linear_fwd(x, w)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, Tensor | None]:
        x, w = ctx.saved_tensors
        g = g.to(w.dtype)
        gx = (g @ w).to(x.dtype) if ctx.needs_input_grad[0] else None
        gw = (g.t() @ x.to(w.dtype)) if ctx.needs_input_grad[1] else None
        return gx, gw


class LinearTree(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, n_chunks: int) -> Tensor:
        ctx.save_for_backward(x, w)
        return lin.linear_tree_fwd(x, w, n_chunks)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        x, w = ctx.saved_tensors
        g = g.to(w.dtype)
        gx = (g @ w).to(x.dtype) if ctx.needs_input_grad[0] else None
        gw = (g.t() @ x.to(w.dtype)) if ctx.needs_input_grad[1] else None
        return gx, gw, None


def _swiglu_grads(x: Tensor, w1: Tensor, w3: Tensor, g: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Grads of silu(x w1^T) * (x w3^T) for one weight pair (fp32 internally)."""
    xf = x.to(w1.dtype)
    a1 = (xf @ w1.t()).float()
    a3 = (xf @ w3.t()).float()
    sig = torch.sigmoid(a1)
    gf = g.float()
    da3 = gf * a1 * sig
    da1 = gf * a3 * sig * (1 + a1 * (1 - sig))
    da1, da3 = da1.to(w1.dtype), da3.to(w1.dtype)
    gx = da1 @ w1 + da3 @ w3
    return gx, da1.t() @ xf, da3.t() @ xf


class SwiGLU(torch.autograd.Function):
    """Dense silu(x w1^T) * (x w3^T) (a shared expert, or a dense FFN)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w1: Tensor, w3: Tensor) -> Tensor:
        ctx.save_for_backward(x, w1, w3)
        return lin.swiglu_fwd(x, w1, w3)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        x, w1, w3 = ctx.saved_tensors
        gx, g1, g3 = _swiglu_grads(x, w1, w3, g)
        return gx.to(x.dtype), g1, g3


class GroupedSwiGLU(torch.autograd.Function):
    """Per expert e: silu(x_e w1[e]^T) * (x_e w3[e]^T); rows sorted by expert."""

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, w1: Tensor, w3: Tensor, counts: list[int], tiles: tuple
    ) -> Tensor:
        ctx.save_for_backward(x, w1, w3)
        ctx.counts = counts
        return lin.swiglu_fwd(x, w1, w3, tiles)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple:
        x, w1, w3 = ctx.saved_tensors
        gx = torch.zeros_like(x)
        g1, g3 = torch.zeros_like(w1), torch.zeros_like(w3)
        start = 0
        for e, count in enumerate(ctx.counts):
            if count:
                rows = slice(start, start + count)
                gx[rows], g1[e], g3[e] = _swiglu_grads(x[rows], w1[e], w3[e], g[rows])
            start += count
        return gx, g1, g3, None, None


class GroupedTree(torch.autograd.Function):
    """Per expert e: fp32 tree product h_e @ w2[e].T; rows sorted by expert."""

    @staticmethod
    def forward(
        ctx: Any, h: Tensor, w2: Tensor, counts: list[int], tiles: tuple, n_chunks: int
    ) -> Tensor:
        ctx.save_for_backward(h, w2)
        ctx.counts = counts
        return lin.grouped_tree_fwd(h, w2, tiles, n_chunks)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple:
        h, w2 = ctx.saved_tensors
        gh, gw = torch.zeros_like(h), torch.zeros_like(w2)
        g = g.to(w2.dtype)
        start = 0
        for e, count in enumerate(ctx.counts):
            if count:
                rows = slice(start, start + count)
                gh[rows] = (g[rows] @ w2[e]).to(h.dtype)
                gw[e] = g[rows].t() @ h[rows].to(w2.dtype)
            start += count
        return gh, gw, None, None, None


class RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, gamma: Tensor, eps: float) -> Tensor:
        ctx.save_for_backward(x, gamma)
        ctx.eps = eps
        return rows.rms_norm_fwd(x, gamma, eps)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, Tensor, None]:
        x, gamma = ctx.saved_tensors
        with torch.enable_grad():
            xd = x.detach().float().requires_grad_()
            gd = gamma.detach().float().requires_grad_()
            inv = torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + ctx.eps)
            y = xd * inv * (1.0 + gd)
            gx, gg = torch.autograd.grad(y, (xd, gd), g.float())
        return gx.to(x.dtype), gg.to(gamma.dtype), None


class LogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        out = rows.log_softmax_fwd(x)
        ctx.save_for_backward(out)
        ctx.in_dtype = x.dtype
        return out

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:
        (out,) = ctx.saved_tensors
        gx = g - torch.exp(out) * g.sum(-1, keepdim=True)
        return gx.to(ctx.in_dtype)
