"""What one trainer step cost in generation: groups and rollouts finished while its batch
was being gathered, and why those not trained were set aside.

A window opens when the previous batch is handed to the trainer and closes when the next
one is: every rollout scored or failed in between, and every group judged in between
(informative or zero-variance), counts toward the step that closes it. The controller
adds the closed window to that step's metrics (`as_metrics`) and the progress line shows
it, so "how much was generated per trained sample, and why was the rest dropped" is read
off each step. No Ray here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class GenerationWindow:
    groups: int = 0  # groups judged: informative + zero-variance
    zero_variance_groups: int = 0
    zero_variance_rollouts: int = 0
    rollouts_scored: int = 0
    rollouts_failed: int = 0
    rewards: list[float] = field(default_factory=list)  # every scored rollout's reward

    def as_metrics(self) -> dict[str, Any]:
        """The step's generation figures (`reward_mean` is over every rollout it scored:
        a zero-variance group of failures is still the policy failing)."""
        out: dict[str, Any] = {
            "generated_groups": self.groups,
            "generated_rollouts": self.rollouts_scored + self.rollouts_failed,
            "filtered_zero_variance": self.zero_variance_rollouts,
            "failed_rollouts": self.rollouts_failed,
        }
        if self.rewards:
            out["reward_mean"] = sum(self.rewards) / len(self.rewards)
        return out
