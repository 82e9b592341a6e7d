"""Fused forms of the model's glue (norm + cast, residual add + norm, the MoE combine + the
next norm, the sigmoid), one launch each on the Triton path where the unfused form takes
several.

Each function is, on every path, bitwise the unfused expression it replaces, so a caller
may take either form and engine and trainer still agree:
- reference path (CPU): the unfused torch expression itself;
- Triton path with autograd needed (training): the norms are the fused kernels below
  as one autograd node each with a one-kernel backward (`triton_ops.autograd.RMSNormTo`,
  `AddRMSNormTo`); the sigmoid is the Triton kernel with a torch backward;
- Triton path without autograd (inference, the trainer's no-grad forwards): one fused
  kernel computing the same values in the same order (`triton_ops.rows`: the norm's
  reduction is the same kernel, specialised; no FMA contraction in any of them).
Invariant: importing this module imports torch only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from rlsys import kernels
from rlsys.kernels import reference
from rlsys.kernels.dispatch import use_triton

if TYPE_CHECKING:
    from rlsys.kernels.triton_ops.partials import Partials


def needs_grad(*tensors: Tensor) -> bool:
    """Whether autograd will record an op on these tensors."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def fusable(*tensors: Tensor) -> bool:
    """Triton path and no autograd: the fused inference kernels may run."""
    return use_triton(tensors[0]) and not needs_grad(*tensors)


def partials_ok(x: Tensor) -> bool:
    """`fusable`, and the invariant products are in use: a product may then hand its
    unreduced chunk products to the kernel that consumes it (`triton_ops.partials`).
    (Benchmarks that swap the products for plain cuBLAS swap this to False.)"""
    return fusable(x)


def sigmoid(x: Tensor, out_dtype: torch.dtype = torch.float32) -> Tensor:
    """fp32 sigmoid rounded to `out_dtype`; on the Triton path the kernel the fused
    epilogues share, its rounding inside the one autograd node."""
    if not use_triton(x):
        return reference.sigmoid(x).to(out_dtype)
    from rlsys.kernels.triton_ops.elementwise import Sigmoid

    return Sigmoid.apply(x, out_dtype)


def rms_norm_to(x: Tensor, gamma: Tensor, eps: float, dtype: torch.dtype) -> Tensor:
    """`rms_norm(x, gamma, eps).to(dtype)`."""
    if not use_triton(x):
        return kernels.rms_norm(x, gamma, eps).to(dtype)
    if needs_grad(x, gamma):
        from rlsys.kernels.triton_ops.autograd import RMSNormTo

        return RMSNormTo.apply(x, gamma, eps, dtype)
    from rlsys.kernels.triton_ops.rows import rms_norm_fwd

    return rms_norm_fwd(x, gamma, eps, dtype)


def add_rms_norm_to(
    h: Tensor, a: Any, gamma: Tensor, eps: float, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """`(h + a.float(), rms_norm(h + a.float(), gamma, eps).to(dtype))`; on the fused path
    `a` may also be a product's unreduced chunk products (`triton_ops.partials.Partials`)."""
    if isinstance(a, Tensor):
        if not use_triton(h):
            h = h + a.float()
            return h, kernels.rms_norm(h, gamma, eps).to(dtype)
        if needs_grad(h, a, gamma):
            from rlsys.kernels.triton_ops.autograd import AddRMSNormTo

            return AddRMSNormTo.apply(h, a, gamma, eps, dtype)
    from rlsys.kernels.triton_ops.rows import add_rms_norm_fwd

    return add_rms_norm_fwd(h, a, gamma, eps, dtype)


@dataclass(frozen=True)
class CombineInputs:
    """The operands of the fused inference MoE's combine (`triton_ops.moe_route.combine_fwd`:
    h + shared + sum_j gates[:, j] * ys[pos[:, j]]), not yet combined: what `MoE` returns
    when its output goes straight into the next block's norm (`combine_rms_norm_to`)."""

    h: Tensor  # (N, d) fp32, the residual entering the MoE
    ys: Tensor | Partials  # (N * k, d) fp32 the experts' rows, sorted by expert
    pos: Tensor  # (N, k) the sorted row of each (token, slot)
    gates: Tensor  # (N, k)
    shared: Tensor | Partials | None  # (N, d) fp32 the shared expert's output, if any

    def materialise(self) -> Tensor:
        """h + the MoE's output, (N, d) fp32: `combine_fwd` itself."""
        from rlsys.kernels.triton_ops.moe_route import combine_fwd

        return combine_fwd(self.h, self.ys, self.pos, self.gates, self.shared)


def combine_rms_norm_to(
    inputs: CombineInputs, gamma: Tensor, eps: float, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """`(h := inputs.materialise(), rms_norm(h, gamma, eps).to(dtype))` in one launch
    (`triton_ops.combine_norm`; `CombineInputs` exist only on the fused inference path)."""
    from rlsys.kernels.triton_ops.combine_norm import combine_rms_norm_fwd

    return combine_rms_norm_fwd(inputs, gamma, eps, dtype)
