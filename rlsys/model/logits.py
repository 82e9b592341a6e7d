"""Log-probs for RL: full-vocabulary or restricted to a recorded top-p candidate set, and
the zero-center projection of the logit gradient.

Invariants:
- Log-softmax goes through `kernels.log_softmax` over the full vocabulary; tokens outside
  the candidate set are masked to -inf first, so the reduction has one fixed length.
- `zero_center` is the identity forward; its backward removes the mean of the incoming
  gradient over the vocabulary, or over the candidate set (non-candidates keep their zero).
  The gradient it returns has, per row, a sum that is zero to fp32 rounding in every
  dtype, bf16 included (`tests/trainer/test_zero_center_bf16.py`).

Why the residual feedback: for softmax cross-entropy the exact logit gradient already sums
to zero; what breaks the sum is the rounding of the gradient to the compute dtype (bf16:
8 significant bits, a row sum off by ~2^-9 of the largest entry). Removing the mean in fp32
and casting back rounds again, so the sum stays off by as much (measured: worst row
3.2e-3 without the projection, 2.0e-3 with it). So after the cast, the residual row sum is
subtracted from the row's smallest allowed entry, where bf16's absolute rounding is finest;
two rounds take the residual from ~2^-9 to ~2^-27 of the largest entry.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from rlsys import kernels


def candidate_mask(candidates: Tensor, vocab_size: int) -> Tensor:
    """(..., C) token ids padded with -1 -> (..., V) bool."""
    ids = torch.where(candidates < 0, vocab_size, candidates)
    mask = torch.zeros(
        *candidates.shape[:-1], vocab_size + 1, dtype=torch.bool, device=candidates.device
    )
    return mask.scatter(-1, ids, True)[..., :vocab_size]


class _ZeroCenter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: Tensor, mask: Tensor | None) -> Tensor:
        ctx.mask = mask
        return logits.view_as(logits)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        from rlsys.kernels.dispatch import use_triton

        if use_triton(grad):  # the same projection in one launch
            from rlsys.kernels.triton_ops.zero_center import zero_center_bwd

            rounds = _RESIDUAL_ROUNDS if grad.dtype != torch.float32 else 0
            return zero_center_bwd(grad, ctx.mask, rounds), None
        g = grad.float()
        m = torch.ones_like(g) if ctx.mask is None else ctx.mask.to(g.dtype)
        mean = (g * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp_min(1.0)
        out = (g - m * mean).to(grad.dtype)
        if grad.dtype != torch.float32:
            out = _feed_back_residual(out, m)
        return out, None


_RESIDUAL_ROUNDS = 2  # each round shrinks the row sum by ~2^-9 (bf16); two reach fp32 level


def _feed_back_residual(out: Tensor, m: Tensor) -> Tensor:
    """Subtract each row's residual sum from its smallest allowed entry (see the docstring)."""
    for _ in range(_RESIDUAL_ROUNDS):
        residual = (out.float() * m).sum(-1, keepdim=True)
        magnitude = out.float().abs().masked_fill(m == 0, float("inf"))
        idx = magnitude.argmin(-1, keepdim=True)
        fixed = (out.gather(-1, idx).float() - residual).to(out.dtype)
        out = out.scatter(-1, idx, fixed)
    return out


def zero_center(logits: Tensor, mask: Tensor | None = None) -> Tensor:
    """Identity; the gradient flowing back through it has zero mean over vocab / `mask`."""
    return _ZeroCenter.apply(logits, mask)


def token_log_probs(logits: Tensor, targets: Tensor, candidates: Tensor | None = None) -> Tensor:
    """log p(target) (fp32, shape of targets) under softmax over the vocab or the candidates.

    A target outside its candidate set gets -inf (it could not have been sampled).
    """
    if candidates is not None:
        logits = logits.masked_fill(~candidate_mask(candidates, logits.shape[-1]), float("-inf"))
    logp = kernels.log_softmax(logits)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
