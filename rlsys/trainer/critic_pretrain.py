"""The job's critic pre-training: value regression on demonstrations before RL starts.

An untrained critic is useless as a baseline, so it is held back for `warmup_updates`
updates; without pre-training those are the first RL steps, which then run on the group
baseline while the critic learns from them. Pre-training fits the critic to the returns of
the warm-start demonstrations (what the warm-started policy imitates) first, so its
baseline is ready at step 1 (with `pretrain_steps >= warmup_updates`).

Invariant: pre-training moves the critic only; the policy's weights and optimiser state are
untouched (`Trainer.pretrain_critic` runs the policy forward without gradient).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from rlsys.trainer.batch import micro_batches, pack
from rlsys.trainer.forward import packed_hidden
from rlsys.trainer.trainer import Trainer
from rlsys.trajectory import Trajectory


def pretrain_critic_on_demonstrations(
    trainer: Trainer, demonstrations: Sequence[Trajectory]
) -> dict[str, float] | None:
    """`algo.critic.pretrain_steps` value-regression steps; None when there is nothing to do."""
    steps = trainer.algo.critic.pretrain_steps
    if trainer.critic is None or steps == 0 or not demonstrations:
        return None
    losses = trainer.pretrain_critic(demonstrations, steps)
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
