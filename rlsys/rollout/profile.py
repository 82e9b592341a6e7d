"""Task profiling: how long and how deep each rollout went, and how a group discriminates.

Duration is turns and tokens; depth is files touched and lines edited (writes through the
`write_file` tool; edits a shell command makes are not counted). `group_reward_stats`
gives the per-group reward variance: a group whose rewards are all equal carries no
learning signal under group-relative advantages, which is what the trainer filters.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from rlsys.trajectory import Trajectory


@dataclass(frozen=True)
class RolloutProfile:
    turns: int
    policy_tokens: int
    observation_tokens: int  # non-policy tokens appended after the first prompt
    prompt_tokens: int  # tokens of the first segment's prompt
    segments: int
    compactions: int
    tool_calls: int
    penalties: int
    files_touched: list[str] = field(default_factory=list)
    lines_edited: int = 0
    wall_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def profile_trajectory(
    trajectory: Trajectory,
    *,
    tool_calls: int,
    files_touched: set[str],
    lines_edited: int,
    wall_s: float,
) -> RolloutProfile:
    policy = trajectory.num_policy_tokens
    total = sum(len(s.token_ids) for s in trajectory.segments)
    first = trajectory.segments[0] if trajectory.segments else None
    prompt = sum(1 for t in first.turn_index if t == -1) if first else 0
    prompts = sum(sum(1 for t in s.turn_index if t == -1) for s in trajectory.segments)
    return RolloutProfile(
        turns=trajectory.num_turns,
        policy_tokens=policy,
        observation_tokens=total - policy - prompts,
        prompt_tokens=prompt,
        segments=len(trajectory.segments),
        compactions=max(len(trajectory.segments) - 1, 0),
        tool_calls=tool_calls,
        penalties=len(trajectory.turn_penalties),
        files_touched=sorted(files_touched),
        lines_edited=lines_edited,
        wall_s=round(wall_s, 4),
    )


@dataclass(frozen=True)
class GroupRewardStats:
    size: int
    mean: float
    variance: float  # population variance of the group's rewards

    @property
    def discriminative(self) -> bool:
        """False when every member got the same reward (no signal)."""
        return self.size > 1 and self.variance > 0.0


def group_reward_stats(rewards: Sequence[float]) -> GroupRewardStats:
    if not rewards:
        return GroupRewardStats(0, 0.0, 0.0)
    return GroupRewardStats(len(rewards), statistics.fmean(rewards), statistics.pvariance(rewards))


def discriminativeness(groups: Mapping[str, Sequence[float]]) -> dict[str, Any]:
    """Per task or batch: the share of groups with non-zero reward variance, and the mean."""
    stats = [group_reward_stats(r) for r in groups.values()]
    if not stats:
        return {"groups": 0, "discriminative_fraction": 0.0, "mean_variance": 0.0}
    return {
        "groups": len(stats),
        "discriminative_fraction": sum(s.discriminative for s in stats) / len(stats),
        "mean_variance": statistics.fmean(s.variance for s in stats),
    }
