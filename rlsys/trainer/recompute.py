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

import torch

from rlsys.trainer.trainer import Trainer
from rlsys.trajectory import Generation, Segment, Trajectory


def as_trajectory(index: int, context: list[int], result: Generation) -> Trajectory:
    seg = Segment()
    seg.append(context, turn=-1, policy=False)
    seg.append_generation(result, turn=0)
    return Trajectory(f"align-{index}", f"align-{index}", "align", [seg], num_turns=1)


def trainer_logprob_diff(
    trainer: Trainer, pairs: Sequence[tuple[list[int], Generation]]
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
