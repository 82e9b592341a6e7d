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


def per_token_terms(
    cfg: AlgoConfig, logp: Tensor, behaviour: Tensor, adv: Tensor, ref: Tensor | None = None
) -> tuple[Tensor, Tensor | None]:
    """Per-token objective and KL-to-reference terms (any shape; KL None when kl_coef is 0).

    The loss of a token is `pg + kl_coef * kl`; `policy_loss` aggregates them over a padded
    batch, the trainer weights them with `TOKEN_WEIGHTS` over micro-batches.
    """
    pg = OBJECTIVES[cfg.objective](logp, behaviour, adv, tis_cap=cfg.tis_cap, clip_eps=cfg.clip_eps)
    if cfg.kl_coef == 0:
        return pg, None
    if ref is None:
        raise ValueError("algo.kl_coef > 0 needs reference log-probs")
    return pg, kl_k3(logp, ref)


def policy_loss(
    cfg: AlgoConfig,
    logp_BT: Tensor,
    behaviour_BT: Tensor,
    adv_BT: Tensor,
    mask_BT: Tensor,
    ref_BT: Tensor | None = None,
) -> LossOutput:
    """The scalar loss for one batch, and diagnostics (no gradient in the diagnostics)."""
    pg_tok, kl_tok = per_token_terms(cfg, logp_BT, behaviour_BT, adv_BT, ref_BT)
    aggregate = AGGREGATIONS[cfg.aggregation]
    pg = aggregate(pg_tok, mask_BT)
    kl = aggregate(kl_tok, mask_BT) if kl_tok is not None else torch.zeros((), dtype=pg.dtype)
    with torch.no_grad():
        w = importance_weights(logp_BT, behaviour_BT, float("inf"))
        m = mask_BT.to(w.dtype)
        mean_w = (w * m).sum() / m.sum().clamp_min(1.0)
        clipped = ((w > cfg.tis_cap).to(w.dtype) * m).sum() / m.sum().clamp_min(1.0)
    return LossOutput(pg + cfg.kl_coef * kl, pg.detach(), kl.detach(), mean_w, clipped)
