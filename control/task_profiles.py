"""Per-prompt task profiles: what the planner knows of each prompt, and which it draws next.

With a task set (`rollout.curriculum.task_set` N), each prompt (instance index 0..N-1)
keeps its last `window` rewards. A group of G rollouts of a prompt that passes with
probability p carries a learning signal (rewards that differ) with probability
1 - p^G - (1 - p)^G, so prompts are drawn in proportion to that, with p estimated from the
prompt's own window shrunk toward the pass rate over all prompts (a prompt not yet tried
gets the latter). A prompt whose last `retire_after` rollouts all passed is solved and
retires; one whose last `rare_after` all failed is drawn with `rare_weight` only. Without
a task set every group gets a fresh random index (nothing to steer).

Invariants:
- only scored rollouts are recorded: a failed rollout has no reward (an infrastructure
  failure says nothing about the prompt, and is never counted as reward 0);
- a retired prompt is never drawn while any other is left; every prompt not retired has
  weight >= `rare_weight` > 0 unless `rare_weight` is 0, so none starves;
- draws are a pure function of the seed and the recorded history; `from_history` rebuilds
  the profiles of a resumed job from the ledger (each rollout keeps its task id and reward).
Pure Python, no Ray: unit-tested.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Iterable

from rlsys.config.curriculum import CurriculumConfig

PRIOR_ROLLOUTS = 2.0  # how many rollouts' worth the all-prompt pass rate weighs in a profile
UNBOUNDED_INDEX = 1 << 30
FRESH_WINDOW = 64  # rollouts the fresh-prompt pass rate is taken over


class TaskProfiles:
    def __init__(self, cfg: CurriculumConfig, group_size: int, rng: random.Random) -> None:
        self.cfg, self.group_size, self.rng = cfg, group_size, rng
        self.recent: dict[int, deque[bool]] = {}  # prompt -> passed?, last `window`
        self.retired: set[int] = set()
        self.stream: deque[bool] = deque(maxlen=cfg.solved_window)  # unbounded: last rollouts
        self.seen: dict[int, int] = {}  # prompt -> rollouts recorded, ever
        # Rollouts of a prompt's first group: the policy meeting prompts it was not steered
        # to by their history, so their pass rate measures it without the curriculum's bias.
        self.fresh: deque[bool] = deque(maxlen=FRESH_WINDOW)

    @property
    def bounded(self) -> bool:
        return self.cfg.task_set is not None

    def record(self, task_index: int, reward: float) -> None:
        """One scored rollout of `task_index`."""
        passed = reward >= self.cfg.pass_reward
        self.stream.append(passed)
        seen = self.seen[task_index] = self.seen.get(task_index, 0) + 1
        if seen <= self.group_size:
            self.fresh.append(passed)
        if not self.bounded:
            return
        window = self.recent.setdefault(task_index, deque(maxlen=self.cfg.window))
        window.append(passed)
        if _last_all(window, self.cfg.retire_after, True):
            self.retired.add(task_index)

    def draw(self) -> int:
        """The prompt of the next group."""
        if self.cfg.task_set is None:
            return self.rng.randrange(UNBOUNDED_INDEX)
        weights = self.weights()
        if not any(weights):  # every prompt retired (a job not set to end when solved)
            return self.rng.randrange(self.cfg.task_set)
        return self.rng.choices(range(self.cfg.task_set), weights=weights)[0]

    def weights(self) -> list[float]:
        """Each prompt's relative chance to be drawn next."""
        assert self.cfg.task_set is not None
        overall = self._overall_pass_rate()
        return [self._weight(i, overall) for i in range(self.cfg.task_set)]

    def _weight(self, index: int, overall: float) -> float:
        if index in self.retired:
            return 0.0
        window = self.recent.get(index, ())
        if _last_all(window, self.cfg.rare_after, False):
            return self.cfg.rare_weight
        if not self.cfg.steer or self.group_size == 1:
            return 1.0
        p = (sum(window) + PRIOR_ROLLOUTS * overall) / (len(window) + PRIOR_ROLLOUTS)
        signal = 1.0 - p**self.group_size - (1.0 - p) ** self.group_size
        return max(signal, self.cfg.rare_weight)

    def _overall_pass_rate(self) -> float:
        seen = [p for w in self.recent.values() for p in w]
        return sum(seen) / len(seen) if seen else 0.5

    def pass_rate(self) -> float | None:
        """The task's pass rate: over a task set, the mean of each prompt's recent pass rate
        (retired prompts 1, prompts not yet tried 0); without one, over the last
        `solved_window` rollouts (None until that many were scored)."""
        if self.cfg.task_set is None:
            if len(self.stream) < self.cfg.solved_window:
                return None
            return sum(self.stream) / len(self.stream)
        total = len(self.retired) + sum(
            sum(w) / len(w) for i, w in self.recent.items() if i not in self.retired and w
        )
        return total / self.cfg.task_set

    def fresh_pass_rate(self) -> float | None:
        """The pass rate of the last rollouts of prompts in their first group (None before
        any): how the policy does on prompts nothing steered it to."""
        return sum(self.fresh) / len(self.fresh) if self.fresh else None

    def solved(self) -> bool:
        rate, goal = self.pass_rate(), self.cfg.solved_pass_rate
        return goal is not None and rate is not None and rate >= goal

    def mix(self) -> dict[str, int]:
        """How the task set stands: prompts retired, looking impossible, learning, untried."""
        if self.cfg.task_set is None:
            return {}
        rare = sum(
            1
            for i, w in self.recent.items()
            if i not in self.retired and _last_all(w, self.cfg.rare_after, False)
        )
        return {
            "retired": len(self.retired),
            "rare": rare,
            "learning": len(self.recent) - len(self.retired) - rare,
            "untried": self.cfg.task_set - len(self.recent),
        }

    @classmethod
    def from_history(
        cls,
        cfg: CurriculumConfig,
        group_size: int,
        rng: random.Random,
        history: Iterable[tuple[int, float]],
    ) -> TaskProfiles:
        """Profiles as they stood after `history` ((task index, reward), oldest first)."""
        profiles = cls(cfg, group_size, rng)
        for index, reward in history:
            profiles.record(index, reward)
        return profiles


def _last_all(window: Iterable[bool], n: int, value: bool) -> bool:
    """Whether the last `n` entries of `window` exist and all equal `value`."""
    items = list(window)
    return len(items) >= n and all(x is value for x in items[-n:])
