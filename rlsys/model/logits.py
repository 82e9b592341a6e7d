"""Log-probs for RL: full-vocabulary or restricted to a recorded top-p candidate set, and
the zero-center projection of the logit gradient.

Invariants:
- Log-softmax goes through `kernels.log_softmax` over the full vocabulary; tokens outside
  the candidate set are masked to -inf first, so the reduction has one fixed length.
- `zero_center` is the identity forward; its backward removes the mean of the incoming
  gradient over the vocabulary, or over the candidate set (non-candidates keep their zero).
  The mean is taken in fp32 and the result cast back, so the sum is zero to the rounding
  of the gradient's dtype.
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
        g = grad.float()
        if ctx.mask is None:
            g = g - g.mean(-1, keepdim=True)
        else:
            m = ctx.mask.to(g.dtype)
            mean = (g * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp_min(1.0)
            g = g - m * mean
        return g.to(grad.dtype), None


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
