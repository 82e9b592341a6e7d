"""Synthetic demonstrations for a supervised warm start, deterministic from a seed.

A demonstration is a real rollout of the real scaffold driven by the task's oracle turns
(`Task.oracle_turns`) through `ReplayGenerator`, so its token layout (prompt, policy turns,
observations, masks) is exactly what RL rollouts produce. Same seed, same task config,
same slip rate -> the same demonstrations, token for token.

A slip rate r makes the demonstrator imperfect: each demonstration independently (seeded)
follows `Task.slip_turns` instead of the oracle with probability r. A warm start on them
hands RL a policy that keeps a known share of mistakes however well it fits the demos, so
the RL phase has headroom on every machine (an oracle-only warm start that happens to
converge leaves almost none). Invariant: an oracle demonstration scores exactly 1 and a
slip exactly 0, or this raises.
"""

from __future__ import annotations

import random

from rlsys.rollout.events import NullEventSink
from rlsys.rollout.replay import ReplayGenerator
from rlsys.rollout.scaffold import ScaffoldConfig, run_rollout
from rlsys.rollout.tasks.base import SandboxFactory, Task
from rlsys.tokenizer import ByteTokenizer
from rlsys.trajectory import Trajectory


def demonstration_indices(seed: int, count: int) -> list[int]:
    rng = random.Random(f"demos:{seed}")
    return [rng.randrange(2**31) for _ in range(count)]


def _check_turn_budget(task: str, index: int, turns: list[str], budget: int) -> None:
    """A scripted turn longer than the generation budget would be cut and derail the
    demonstration; say so in the config's terms instead."""
    for turn in turns:
        need = len(ByteTokenizer().encode(turn))
        if need > budget:
            raise ValueError(
                f"a demonstration turn of {task}/{index} is {need} tokens, over the "
                f"{budget}-token turn budget (sampling.max_tokens_per_turn): raise it"
            )


def make_demonstrations(
    task: Task,
    seed: int,
    count: int,
    open_sandbox: SandboxFactory,
    config: ScaffoldConfig | None = None,
    slip_rate: float = 0.0,
) -> list[Trajectory]:
    """`count` demonstrations of `task` on instances drawn from `seed`, a share
    `slip_rate` of them (in expectation) the demonstrator's mistakes."""
    if not 0.0 <= slip_rate < 1.0:
        raise ValueError(f"slip_rate: must be in [0, 1), got {slip_rate}")
    config = config or ScaffoldConfig()
    slips = random.Random(f"slips:{seed}")
    demos = []
    for i, index in enumerate(demonstration_indices(seed, count)):
        instance = task.instance(index)
        slip = slips.random() < slip_rate
        turns = task.slip_turns(instance, slips) if slip else task.oracle_turns(instance)
        _check_turn_budget(task.name, index, turns, config.max_new_tokens)
        generator = ReplayGenerator(turns)
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
        wanted = 0.0 if slip else 1.0
        if outcome.failure is not None or outcome.trajectory.reward != wanted:
            who = "slip" if slip else "oracle"
            raise RuntimeError(
                f"{who} demonstration of {task.name}/{index} should score {wanted}: "
                f"{outcome.failure or outcome.verdict}"
            )
        demos.append(outcome.trajectory)
    return demos
