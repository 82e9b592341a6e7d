"""Reducing a per-token loss to a scalar: token-mean or sequence-mean (a registry).

Each aggregation is defined once, by the weight it gives every policy token, so the trainer
can split a batch into micro-batches and sum `weight * loss` per micro-batch (gradient
accumulation) and still get exactly the aggregation of the whole batch. Invariant: the
weights of a batch's tokens sum to 1 (to 0 when it has no tokens).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def token_mean_weights(sample_P: Tensor, num_samples: int) -> Tensor:
    """Every policy token weighs the same, whatever its sequence's length."""
    del num_samples
    return torch.full(sample_P.shape, 1.0 / max(sample_P.numel(), 1))


def seq_mean_weights(sample_P: Tensor, num_samples: int) -> Tensor:
    """Every sequence with tokens weighs the same: mean over its tokens, then over sequences."""
    counts = torch.bincount(sample_P, minlength=num_samples).to(torch.float32)
    with_tokens = int((counts > 0).sum())
    return 1.0 / (counts[sample_P] * max(with_tokens, 1))


TOKEN_WEIGHTS: dict[str, Callable[[Tensor, int], Tensor]] = {
    "token_mean": token_mean_weights,
    "seq_mean": seq_mean_weights,
}
"""Aggregation name -> f(sample index of each policy token (P,), number of samples) -> (P,)."""


def aggregate(name: str, loss_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """The aggregation `name` of a padded (B, T) per-token loss over its masked tokens."""
    rows = torch.arange(mask_BT.shape[0]).unsqueeze(1).expand_as(mask_BT)[mask_BT]
    weights = TOKEN_WEIGHTS[name](rows, mask_BT.shape[0]).to(loss_BT.dtype)
    return (loss_BT[mask_BT] * weights).sum()


def token_mean(loss_BT: Tensor, mask_BT: Tensor) -> Tensor:
    return aggregate("token_mean", loss_BT, mask_BT)


def seq_mean(loss_BT: Tensor, mask_BT: Tensor) -> Tensor:
    return aggregate("seq_mean", loss_BT, mask_BT)


AGGREGATIONS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    name: (lambda loss, mask, name=name: aggregate(name, loss, mask)) for name in TOKEN_WEIGHTS
}
