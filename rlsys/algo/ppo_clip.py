"""PPO clipped surrogate with the behaviour policy as the old policy.

per-token loss = -min(r * A, clip(r, 1 - eps, 1 + eps) * A),  r = exp(logp - logp_behaviour)

With several optimiser steps on one batch the clip keeps the update near the policy that
generated the data; truncation (`tis_cap`) additionally caps r from above for very stale
samples.
"""

from __future__ import annotations

import torch
from torch import Tensor


def ppo_clip_loss(
    logp_BT: Tensor, behaviour_BT: Tensor, adv_BT: Tensor, *, tis_cap: float, clip_eps: float
) -> Tensor:
    ratio = torch.exp(logp_BT - behaviour_BT).clamp(max=tis_cap)
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps)
    return -torch.minimum(ratio * adv_BT, clipped * adv_BT)
