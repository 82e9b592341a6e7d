"""Supervised warm start: token-level cross-entropy on the policy tokens of demonstrations.

Demonstrations are trajectories with the exact token layout of RL rollouts (prompt, policy
turns, observations); only policy tokens are trained, observations and prompts are context.
The log-probs go through the trainer's own path (packed forward, chunked LM head over the
sampleable vocabulary), so what the warm start optimises is what the engine will sample.
It uses its own AdamW (the RL optimiser's state is untouched) and does not bump the policy
version: the engine receives the warm-started weights as version 0.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from rlsys.model import Transformer
from rlsys.trainer.batch import pack
from rlsys.trainer.forward import packed_hidden
from rlsys.trainer.logprobs import LogProbOptions, policy_log_probs
from rlsys.trajectory import Trajectory


def supervised_warm_start(
    model: Transformer,
    demonstrations: Sequence[Trajectory],
    *,
    steps: int,
    lr: float,
    batch_size: int,
    options: LogProbOptions,
    grad_clip: float = 1.0,
    seed: int = 0,
) -> list[float]:
    """`steps` AdamW steps on batches drawn without replacement (reshuffled each epoch);
    returns the mean per-token negative log-likelihood of each step."""
    if not demonstrations:
        raise ValueError("warm start needs at least one demonstration")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rng = random.Random(f"warm-start:{seed}")
    order: list[int] = []
    losses = []
    model.train()
    for _ in range(steps):
        batch_ids = []
        while len(batch_ids) < min(batch_size, len(demonstrations)):
            if not order:
                order = list(range(len(demonstrations)))
                rng.shuffle(order)
            batch_ids.append(order.pop())
        chosen = [demonstrations[d] for d in batch_ids]
        batch = pack(
            [(i, s, t) for i, t in enumerate(chosen) for s in t.segments], with_routes=False
        )
        h = packed_hidden(model, batch, "off")
        out = policy_log_probs(
            model,
            h[batch.pred_rows_P],
            batch.targets_P,
            batch.candidates_PC,
            batch.has_candidates_P,
            options,
        )
        loss = -out.logp_P.mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        model.update_balance()
        losses.append(float(loss.detach()))
    optimizer.zero_grad(set_to_none=True)
    return losses
