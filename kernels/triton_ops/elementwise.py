"""Elementwise pieces shared by the fused kernels: the sigmoid, and its standalone launch.

Why a Triton sigmoid (torch's would do): the fused kernels compute gates and router scores
inside their epilogues (`qkv_post`, `moe_route`), and the unfused path (training, with
autograd) must produce the same bits. Every kernel that evaluates `sigmoid` here launches
without FMA contraction (`enable_fp_fusion=False`), so `1 / (1 + exp(-x))` rounds as
written, identically in a fused epilogue and in `sigmoid_fwd`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from rlsys.kernels.triton_ops import pdl
from rlsys.kernels.triton_ops.common import check_device

BLOCK = 1024


@triton.jit
def sigmoid(x):
    """fp32 `1 / (1 + exp(-x))`."""
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _sigmoid(X, Y, n, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    pdl.wait_prior(PDL)
    pdl.release_next(PDL)
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + i, mask=i < n, other=0.0).to(tl.float32)
    tl.store(Y + i, sigmoid(x), mask=i < n)


def sigmoid_fwd(x: Tensor) -> Tensor:
    """fp32 sigmoid of any tensor (read in its dtype)."""
    check_device(x)
    src = x.contiguous()
    out = torch.empty(src.shape, dtype=torch.float32, device=x.device)
    if src.numel():
        _sigmoid[(triton.cdiv(src.numel(), BLOCK),)](
            src, out, src.numel(), BLOCK=BLOCK, enable_fp_fusion=False, **pdl.launch(x.device)
        )
    return out


class Sigmoid(torch.autograd.Function):
    """`sigmoid_fwd` forward (bitwise the fused epilogues' sigmoid), rounded to `out_dtype`
    inside the node (no cast node of its own); torch backward from the fp32 values."""

    @staticmethod
    def forward(  # type: ignore[no-untyped-def, override]
        ctx, x: Tensor, out_dtype: torch.dtype = torch.float32
    ) -> Tensor:
        y = sigmoid_fwd(x)
        ctx.save_for_backward(y)
        ctx.in_dtype = x.dtype
        return y.to(out_dtype)

    @staticmethod
    def backward(ctx, g: Tensor) -> tuple[Tensor, None]:  # type: ignore[no-untyped-def, override]
        (y,) = ctx.saved_tensors
        # one kernel; a bf16 upstream gradient is promoted exactly to fp32 inside it
        return torch.ops.aten.sigmoid_backward(g, y).to(ctx.in_dtype), None
