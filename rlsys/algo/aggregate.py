"""Reducing a per-token loss to a scalar: token-mean or sequence-mean (a registry)."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor


def token_mean(loss_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """Every policy token weighs the same, whatever its sequence's length."""
    m = mask_BT.to(loss_BT.dtype)
    return (loss_BT * m).sum() / m.sum().clamp_min(1.0)


def seq_mean(loss_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """Every sequence weighs the same: mean over its tokens, then over sequences."""
    m = mask_BT.to(loss_BT.dtype)
    per_seq = (loss_BT * m).sum(-1) / m.sum(-1).clamp_min(1.0)
    has_tokens = (m.sum(-1) > 0).to(loss_BT.dtype)
    return (per_seq * has_tokens).sum() / has_tokens.sum().clamp_min(1.0)


AGGREGATIONS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "token_mean": token_mean,
    "seq_mean": seq_mean,
}
