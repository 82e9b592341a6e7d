"""Kernels: the one place where the model's reductions are implemented.

The model calls only the names exported here (and their fused inference forms in
`rlsys.kernels.fused`, bitwise the same values). Each dispatches on its input's device
(`rlsys.kernels.dispatch`): the batch-invariant Triton kernels (`rlsys.kernels.triton_ops`)
on CUDA, the plain-torch reference (`rlsys.kernels.reference`) on the CPU. The reference
is the oracle: tests/kernels checks every Triton kernel against it (through Triton's
interpreter on the CPU, at real shapes on the GPU).
Invariant: importing this package imports torch only (triton is imported at the first
call that runs a Triton kernel; no ray/redis/sqlalchemy).
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlsys.kernels import reference
from rlsys.kernels.dispatch import use_triton
from rlsys.kernels.reference import (
    block_attention,
    matmul_nt,
    moe_combine,
    sigmoid,
    silu,
)


def linear(x: Tensor, w: Tensor) -> Tensor:
    """`x @ w.T` for x (..., K), w (N, K), row-invariant; computed in w's dtype."""
    if not use_triton(x):
        return reference.linear(x, w)
    from rlsys.kernels.triton_ops.autograd import Linear

    lead, k = x.shape[:-1], x.shape[-1]
    return Linear.apply(x.reshape(-1, k), w).reshape(*lead, w.shape[0])


def rms_norm(x: Tensor, gamma: Tensor, eps: float) -> Tensor:
    """Zero-centred RMSNorm `x / rms(x) * (1 + gamma)` in fp32; returns fp32."""
    if not use_triton(x):
        return reference.rms_norm(x, gamma, eps)
    from rlsys.kernels.triton_ops.autograd import RMSNorm

    return RMSNorm.apply(x, gamma, eps)


def log_softmax(logits: Tensor) -> Tensor:
    """Log-softmax over the last dim in fp32 (each row reduced on its own)."""
    if not use_triton(logits):
        return reference.log_softmax(logits)
    from rlsys.kernels.triton_ops.autograd import LogSoftmax

    return LogSoftmax.apply(logits)


def sequential_sum(x: Tensor, dim: int) -> Tensor:
    """Sum along `dim` as an in-order fold: invariant to exact zeros inserted anywhere.

    On the GPU the fold is written out (a GPU scan's order depends on the launch shape).
    """
    if not use_triton(x):
        return reference.sequential_sum(x, dim)
    from rlsys.kernels.triton_ops.autograd import SequentialSum, in_order_fold

    if x.requires_grad and torch.is_grad_enabled():  # one autograd node, not 2 per element
        return SequentialSum.apply(x, dim)
    return in_order_fold(x, dim)


def normalize_rows(x: Tensor) -> Tensor:
    """`x / x.sum(-1)` with an in-order fold (used for top-k gate normalisation)."""
    return x / sequential_sum(x, dim=-1).unsqueeze(-1)


def routed_gates(scores: Tensor, idx: Tensor) -> Tensor:
    """`normalize_rows(scores.gather(-1, idx))`: the gates of each row's chosen experts
    (idx distinct within a row). On the Triton path with a gradient to take it is one
    autograd node (the same forward bits; the backward one scatter, not the ~15 ops of
    gather, fold and division nodes, per MoE block and micro-batch)."""
    if use_triton(scores) and scores.requires_grad and torch.is_grad_enabled():
        from rlsys.kernels.triton_ops.autograd import RoutedGates

        return RoutedGates.apply(scores, idx)
    return normalize_rows(scores.gather(-1, idx))


__all__ = [
    "block_attention",
    "linear",
    "log_softmax",
    "matmul_nt",
    "moe_combine",
    "normalize_rows",
    "rms_norm",
    "routed_gates",
    "sequential_sum",
    "sigmoid",
    "silu",
]
