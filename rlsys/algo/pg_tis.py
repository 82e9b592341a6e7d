"""Policy gradient with truncated importance sampling (TIS) against the behaviour policy.

per-token loss = -min(exp(logp.detach() - logp_behaviour), cap) * A * logp

At staleness 0 with bitwise-aligned log-probs the weight is exactly 1 and this is plain
REINFORCE with group-relative advantages; for samples from older versions the weight
corrects the off-policy gap, truncated at `cap` to bound the variance.
"""

from __future__ import annotations

import torch
from torch import Tensor


def importance_weights(logp_BT: Tensor, behaviour_BT: Tensor, cap: float) -> Tensor:
    """min(pi_current / pi_behaviour, cap), no gradient."""
    return torch.exp(logp_BT.detach() - behaviour_BT).clamp(max=cap)


def pg_tis_loss(
    logp_BT: Tensor, behaviour_BT: Tensor, adv_BT: Tensor, *, tis_cap: float, clip_eps: float
) -> Tensor:
    """Per-token loss (see module doc). `clip_eps` is unused here (shared signature)."""
    del clip_eps
    return -importance_weights(logp_BT, behaviour_BT, tis_cap) * adv_BT * logp_BT
