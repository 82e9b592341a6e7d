"""Sample filters applied before a step: zero-variance groups and staleness.

Each filter returns the kept samples and, for the dropped ones, the ledger state they end
in (`filtered_zero_variance`, `filtered_stale`) with a reason, so nothing leaves silently.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
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


def split_zero_variance(trajs: Sequence[Trajectory]) -> tuple[list[Trajectory], list[Filtered]]:
    """Drop groups whose rewards are all equal and that carry no turn penalty: they give
    no learning signal (a penalised turn still teaches, so such a group is kept)."""
    groups: dict[str, list[Trajectory]] = defaultdict(list)
    for t in trajs:
        groups[t.group_id].append(t)
    kept, dropped = [], []
    for members in groups.values():
        rewards = {m.reward for m in members}
        if len(rewards) <= 1 and not any(m.turn_penalties for m in members):
            r = next(iter(rewards))
            dropped += [
                Filtered(
                    m.rollout_id, "filtered_zero_variance", f"all {len(members)} rewards = {r}"
                )
                for m in members
            ]
        else:
            kept += members
    return kept, dropped
