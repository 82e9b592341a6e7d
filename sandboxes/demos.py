"""Synthetic demonstrations for a supervised warm start, deterministic from a seed.

A demonstration is a real rollout of the real scaffold driven by the task's oracle turns
(`Task.oracle_turns`) through `ReplayGenerator`, so its token layout (prompt, policy turns,
observations, masks) is exactly what RL rollouts produce; only correct ones (reward 1) are
kept. Same seed, same task config -> the same demonstrations, token for token.
"""

from __future__ import annotations

import random

from rlsys.sandboxes.events import NullEventSink
from rlsys.sandboxes.replay import ReplayGenerator
from rlsys.sandboxes.scaffold import ScaffoldConfig, run_rollout
from rlsys.sandboxes.tasks.base import SandboxFactory, Task
from rlsys.trajectory import Trajectory


def demonstration_indices(seed: int, count: int) -> list[int]:
    rng = random.Random(f"demos:{seed}")
    return [rng.randrange(2**31) for _ in range(count)]


def make_demonstrations(
    task: Task,
    seed: int,
    count: int,
    open_sandbox: SandboxFactory,
    config: ScaffoldConfig | None = None,
) -> list[Trajectory]:
    """`count` oracle rollouts of `task` on instances drawn from `seed`."""
    config = config or ScaffoldConfig()
    demos = []
    for i, index in enumerate(demonstration_indices(seed, count)):
        generator = ReplayGenerator(task.oracle_turns(task.instance(index)))
        outcome = run_rollout(
            task,
            index,
            generator,
            config=config,
            sink=NullEventSink(),
            open_sandbox=open_sandbox,
            rollout_id=f"demo-{seed}-{i}",
            group_id=f"demo-{seed}",
        )
        assert outcome.failure is None and outcome.trajectory.reward == 1.0, (
            f"oracle for {task.name}/{index} did not solve it: {outcome.failure or outcome.verdict}"
        )
        demos.append(outcome.trajectory)
    return demos
