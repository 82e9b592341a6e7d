"""The job's critic pre-training: value regression on demonstrations before RL starts.

An untrained critic is useless as a baseline, so it is held back for `warmup_updates`
updates; without pre-training those are the first RL steps, which then run on the group
baseline while the critic learns from them. Pre-training fits the critic to the returns of
the warm-start demonstrations (what the warm-started policy imitates) first, so its
baseline is ready at step 1 (with `pretrain_steps >= warmup_updates`).

Invariant: pre-training moves the critic only; the policy's weights and optimiser state are
untouched (`fit_critic` runs the policy forward without gradient). Under data parallel
`fit_critic` is a collective: every rank runs the whole (same) computation, so the
replicated critic stays the same on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from rlsys.algo.aggregate import TOKEN_WEIGHTS
from rlsys.trainer.batch import micro_batches, pack
from rlsys.trainer.forward import packed_hidden
from rlsys.trajectory import Trajectory

if TYPE_CHECKING:
    from rlsys.trainer.trainer import Trainer


def fit_critic(trainer: Trainer, trajectories: Sequence[Trajectory], steps: int) -> list[float]:
    """`steps` value-regression updates of the critic on the returns of `trajectories`
    (the policy's hidden states computed once, without gradient); the loss of each."""
    critic = trainer.critic
    assert critic is not None, "algo.critic.enabled is off"
    size = trainer.cfg.micro_batch_tokens
    batches = [
        pack(items, with_routes=False).to(trainer.device)
        for items in micro_batches(trajectories, size)
    ]
    weights = TOKEN_WEIGHTS["token_mean"](
        torch.cat([b.sample_P for b in batches]).cpu(), len(trajectories)
    ).to(trainer.device)
    per_batch = weights.split([b.num_policy_tokens for b in batches])
    was_training = trainer.model.training
    trainer.model.eval()
    try:
        with torch.no_grad():
            hidden = [packed_hidden(trainer.model, b, "off")[b.pred_rows_P] for b in batches]
    finally:
        trainer.model.train(was_training)
    losses = []
    for _ in range(steps):
        total = 0.0
        for b, h, w in zip(batches, hidden, per_batch, strict=True):
            loss, _ = critic.loss(h, b.returns_P, w)
            loss.backward()
            total += float(loss.detach())
        critic.update()
        losses.append(total)
    return losses


def pretrain_critic_on_demonstrations(
    trainer: Trainer, demonstrations: Sequence[Trajectory]
) -> dict[str, float] | None:
    """`algo.critic.pretrain_steps` value-regression steps; None when there is nothing to do."""
    steps = trainer.algo.critic.pretrain_steps
    if trainer.critic is None or steps == 0 or not demonstrations:
        return None
    losses = fit_critic(trainer, demonstrations, steps)
    return {"steps": steps, "loss_first": losses[0], "loss_last": losses[-1]}


def critic_values(trainer: Trainer, trajectories: Sequence[Trajectory]) -> tuple[Tensor, Tensor]:
    """(values, returns) (P,) of every policy token of `trajectories`, without gradient."""
    assert trainer.critic is not None, "algo.critic.enabled is off"
    values, returns = [], []
    was_training = trainer.model.training
    trainer.model.eval()
    try:
        with torch.no_grad():
            for items in micro_batches(trajectories, trainer.cfg.micro_batch_tokens):
                b = pack(items, with_routes=False).to(trainer.device)
                h = packed_hidden(trainer.model, b, "off")[b.pred_rows_P]
                values.append(trainer.critic(h).cpu())
                returns.append(b.returns_P.cpu())
    finally:
        trainer.model.train(was_training)
    return torch.cat(values), torch.cat(returns)


def value_loss(trainer: Trainer, trajectories: Sequence[Trajectory]) -> float:
    """Token-mean squared error of the critic on `trajectories` (the pre-training's loss)."""
    values, returns = critic_values(trainer, trajectories)
    return float(((values - returns) ** 2).mean())
