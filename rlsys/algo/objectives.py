"""The objective registry and the one function the trainer calls: `policy_loss`.

An objective maps per-token (current log-prob, behaviour log-prob, advantage) to a per-token
loss; aggregation then reduces it (token-mean or sequence-mean); an optional KL term to a
reference policy is added per token before aggregation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from rlsys.algo.aggregate import AGGREGATIONS
from rlsys.algo.kl import kl_k3
from rlsys.algo.pg_tis import importance_weights, pg_tis_loss
from rlsys.algo.ppo_clip import ppo_clip_loss
from rlsys.config.algo import AlgoConfig

Objective = Callable[..., Tensor]

OBJECTIVES: dict[str, Objective] = {
    "pg_tis": pg_tis_loss,
    "ppo_clip": ppo_clip_loss,
}


@dataclass
class LossOutput:
    loss: Tensor
    pg_loss: Tensor
    kl: Tensor
    mean_importance_weight: Tensor
    clipped_fraction: Tensor


def policy_loss(
    cfg: AlgoConfig,
    logp_BT: Tensor,
    behaviour_BT: Tensor,
    adv_BT: Tensor,
    mask_BT: Tensor,
    ref_BT: Tensor | None = None,
) -> LossOutput:
    """The scalar loss for one batch, and diagnostics (no gradient in the diagnostics)."""
    per_token = OBJECTIVES[cfg.objective](
        logp_BT, behaviour_BT, adv_BT, tis_cap=cfg.tis_cap, clip_eps=cfg.clip_eps
    )
    aggregate = AGGREGATIONS[cfg.aggregation]
    pg = aggregate(per_token, mask_BT)
    kl = torch.zeros((), dtype=pg.dtype)
    if cfg.kl_coef > 0:
        if ref_BT is None:
            raise ValueError("algo.kl_coef > 0 needs reference log-probs")
        kl = aggregate(kl_k3(logp_BT, ref_BT), mask_BT)
    with torch.no_grad():
        w = importance_weights(logp_BT, behaviour_BT, float("inf"))
        m = mask_BT.to(w.dtype)
        mean_w = (w * m).sum() / m.sum().clamp_min(1.0)
        clipped = ((w > cfg.tis_cap).to(w.dtype) * m).sum() / m.sum().clamp_min(1.0)
    return LossOutput(pg + cfg.kl_coef * kl, pg.detach(), kl.detach(), mean_w, clipped)
