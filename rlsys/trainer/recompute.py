"""The trainer's side of `rlsys align`: recompute engine tokens through the real RL path.

Each (context, engine result) pair becomes a one-turn trajectory, exactly as the scaffold
records one: the context as prompt rows, the generated tokens as policy rows carrying
their log-probs, versions, candidate sets and routed experts. `Trainer.log_probs` then
recomputes them the way a training step does (micro-batch packing, the chunked LM head,
expert-route and candidate-set replay as the job configures them), so a difference here is
a difference the trainer would train on. At staleness 0 it must be exactly 0.0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from rlsys.trainer.trainer import Trainer
from rlsys.trajectory import Segment, Trajectory


class EngineOutput(Protocol):
    """The fields of an engine result the trainer replays (`rlsys.engine.api`)."""

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    candidate_ids: list[list[int]]
    routed_experts: list[object] | None


def as_trajectory(index: int, context: list[int], result: EngineOutput) -> Trajectory:
    seg = Segment()
    seg.append(context, turn=-1, policy=False)
    seg.append(
        result.token_ids,
        turn=0,
        policy=True,
        logprobs=result.logprobs,
        versions=result.versions,
        candidates=result.candidate_ids,
        routed=result.routed_experts,
    )
    return Trajectory(f"align-{index}", f"align-{index}", "align", [seg], num_turns=1)


def trainer_logprob_diff(
    trainer: Trainer, pairs: Sequence[tuple[list[int], EngineOutput]]
) -> tuple[float, int]:
    """Max |engine log-prob - trainer log-prob| over every generated token, and the count."""
    trajs = [as_trajectory(i, ctx, res) for i, (ctx, res) in enumerate(pairs)]
    worst, count = 0.0, 0
    for traj, logp, (_, res) in zip(trajs, trainer.log_probs(trajs), pairs, strict=True):
        engine = torch.tensor(res.logprobs, dtype=torch.float32)
        if logp.numel():
            worst = max(worst, float((logp.float() - engine).abs().max()))
        count += traj.num_policy_tokens
    return worst, count
