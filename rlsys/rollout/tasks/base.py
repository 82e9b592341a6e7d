"""What a task is to the scaffold: instances, an episode per rollout, and a verdict.

A `Task` makes deterministic instances (the same index gives the same prompt and hidden
data on every machine), starts an `Episode` per rollout (tools, their context, the
sandbox it owns), and knows a correct sequence of policy turns for any instance
(`oracle_turns`), from which demonstrations are built, and a plausible wrong one
(`slip_turns`: the demonstrator's mistake, which a warm start may mix in so the policy it
hands to RL keeps a known error rate). A task also names the token ids that carry an
answer (`content_token_ids`), which a warm start may weight up.

Invariants:
- `Episode.score` returns a `Verdict` or raises `RolloutAbort` (a broken sandbox during
  verification); any other exception is a verifier bug and the scaffold maps it to
  `failed_reward`. A failure is never reported as a reward of 0.
- `Episode.close` releases everything the episode opened and is idempotent.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from rlsys.rollout.tools import Tool, ToolContext
from rlsys.sandboxes.base import Sandbox

SandboxFactory = Callable[[], Sandbox]


@dataclass(frozen=True)
class TaskInstance:
    task: str
    index: int
    prompt: str
    data: Mapping[str, Any] = field(default_factory=dict)  # hidden from the policy

    @property
    def task_id(self) -> str:
        return f"{self.task}/{self.index}"


@dataclass(frozen=True)
class Verdict:
    reward: float
    details: dict[str, Any] = field(default_factory=dict)  # JSON-ready


class Episode(Protocol):
    instance: TaskInstance
    tools: Mapping[str, Tool]
    context: ToolContext

    def score(self, answer: str | None) -> Verdict: ...

    def close(self) -> None: ...


class Task(Protocol):
    name: str

    def instance(self, index: int) -> TaskInstance: ...

    def start(self, instance: TaskInstance, open_sandbox: SandboxFactory) -> Episode: ...

    def oracle_turns(self, instance: TaskInstance) -> list[str]: ...

    def slip_turns(self, instance: TaskInstance, rng: random.Random) -> list[str]:
        """Turns of a well-formed attempt that scores 0: the oracle with one realistic
        mistake, drawn from `rng`."""
        ...

    @property
    def content_token_ids(self) -> frozenset[int]:
        """Token ids that carry the answer in a demonstration (empty: no distinction)."""
        ...
