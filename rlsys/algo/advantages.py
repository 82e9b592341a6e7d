"""Advantages: group-relative (GRPO-style) outcome advantages plus turn-level credit.

Invariants:
- within a group the advantages sum to zero (before turn penalties);
- a turn penalty changes the advantage of that turn's policy tokens only; every other
  token of the trajectory keeps the outcome advantage (turn-level credit:
  docs/ARCHITECTURE.md, "One step of data flow", Score).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch
from torch import Tensor


def group_relative(
    rewards: Sequence[float],
    group_ids: Sequence[str],
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> list[float]:
    """(r - mean_group) [/ (std_group + eps)] for each sample."""
    by_group: dict[str, list[int]] = defaultdict(list)
    for i, g in enumerate(group_ids):
        by_group[g].append(i)
    out = [0.0] * len(rewards)
    for idx in by_group.values():
        r = torch.tensor([float(rewards[i]) for i in idx], dtype=torch.float64)
        centred = r - r.mean()
        if normalize_std and len(idx) > 1:
            centred = centred / (r.std(unbiased=False) + eps)
        for i, a in zip(idx, centred.tolist(), strict=True):
            out[i] = a
    return out


def token_advantages(
    advantage: float, turn_index: Sequence[int], turn_penalties: dict[int, float], length: int
) -> Tensor:
    """Per-token advantages of one segment: the outcome advantage, plus each turn's penalty
    on that turn's tokens only."""
    adv = torch.full((length,), float(advantage), dtype=torch.float32)
    if turn_penalties:
        turns = torch.tensor(list(turn_index), dtype=torch.long)
        for turn, penalty in turn_penalties.items():
            adv[turns == turn] += float(penalty)
    return adv


def critic_advantages(returns: Tensor, values: Tensor) -> Tensor:
    """Token-level baseline: the token's return (outcome reward plus its turn's penalty)
    minus the critic's value of the state it was sampled in (no gradient into the critic)."""
    return returns - values.detach()
