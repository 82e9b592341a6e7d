"""Sample filters applied before a step: zero-variance groups and staleness.

Each filter returns the kept samples and, for the dropped ones, the ledger state they end
in (`filtered_zero_variance`, `filtered_stale`) with a reason, so nothing leaves silently.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from rlsys.trajectory import Trajectory


@dataclass(frozen=True)
class Filtered:
    rollout_id: str
    state: str
    reason: str


def split_stale(
    trajs: Sequence[Trajectory], current_version: int, max_staleness: int
) -> tuple[list[Trajectory], list[Filtered]]:
    """Keep samples whose oldest token is at most `max_staleness` versions behind."""
    kept, dropped = [], []
    for t in trajs:
        staleness = current_version - t.min_version
        if staleness > max_staleness:
            dropped.append(
                Filtered(
                    t.rollout_id, "filtered_stale", f"staleness {staleness} > bound {max_staleness}"
                )
            )
        else:
            kept.append(t)
    return kept, dropped


def is_penalised(turn_penalties: Mapping[int, float]) -> bool:
    """Whether a turn of the rollout carries a non-zero penalty (one of 0 teaches nothing)."""
    return any(value != 0.0 for value in turn_penalties.values())


def group_has_signal(rewards: Sequence[float], penalised: Sequence[bool]) -> bool:
    """Whether a group teaches anything under group-relative advantages: its rewards differ,
    or a turn of it was penalised (a penalised turn still teaches). The rollout controller
    sifts finished groups with this, and the trainer filters its batch with it."""
    return len(set(rewards)) > 1 or any(penalised)


def zero_variance_reason(rewards: Sequence[float]) -> str:
    return f"all {len(rewards)} rewards = {rewards[0]}"


def split_zero_variance(trajs: Sequence[Trajectory]) -> tuple[list[Trajectory], list[Filtered]]:
    """Drop groups that carry no learning signal (`group_has_signal`)."""
    groups: dict[str, list[Trajectory]] = defaultdict(list)
    for t in trajs:
        groups[t.group_id].append(t)
    kept, dropped = [], []
    for members in groups.values():
        rewards = [m.reward for m in members]
        if not group_has_signal(rewards, [is_penalised(m.turn_penalties) for m in members]):
            dropped += [
                Filtered(m.rollout_id, "filtered_zero_variance", zero_variance_reason(rewards))
                for m in members
            ]
        else:
            kept += members
    return kept, dropped
