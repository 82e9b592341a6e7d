"""Critic pre-training: variance of the advantages on held-out trajectories, with and without.

A `small` policy warm-started on the quickstart task (`benchmarks/warm_small.py`) and a
fresh critic (`algo.critic` defaults: MLP 128, lr 1e-3). The job pre-trains the critic for
`algo.critic.pretrain_steps` value-regression steps on the warm-start demonstrations
(`rlsys.trainer.critic_pretrain`); here on 256 demonstrations (slip rate 0.3), then the
critic's advantages (return - value) are measured on 128 held-out demonstrations (other
seed, same slip rate): their token-level variance and the value MSE, for 0 (no
pre-training: the critic as RL step 1 would find it), 20, 50 and 100 steps; three critic
seeds each. `constant` is the best constant baseline (the held-out mean return), for scale.

Usage: OMP_NUM_THREADS=1 python benchmarks/bench_critic_pretrain.py [--warm-steps 120]
    [--cache /tmp/rlsys15b_cache]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.warm_small import demonstrations, trainer_for, warm_small  # noqa: E402
from rlsys.config.algo import AlgoConfig, CriticConfig  # noqa: E402
from rlsys.model import Transformer  # noqa: E402
from rlsys.trainer.critic_pretrain import (  # noqa: E402
    critic_values,
    pretrain_critic_on_demonstrations,
)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--warm-steps", type=int, default=120)
    ap.add_argument("--cache", type=Path, default=Path("/tmp/rlsys15b_cache"))
    ap.add_argument("--steps", default="0,20,50,100")
    args = ap.parse_args()
    torch.set_num_threads(1)
    warm = warm_small(args.warm_steps, args.cache)
    model = Transformer(warm.cfg)
    model.load_state_dict(warm.state)
    train = demonstrations(warm.task, 7919, 256, 0.3)
    held_out = demonstrations(warm.task, 4243, 128, 0.3)
    print("| pre-training steps | advantage variance (seeds) | value MSE | held-out tokens |")
    print("|---|---|---|---|")
    returns = None
    for steps in [int(s) for s in args.steps.split(",")]:
        variances, mses = [], []
        for seed in range(3):
            torch.manual_seed(seed)
            critic = CriticConfig(enabled=True, pretrain_steps=steps)
            trainer = trainer_for(model, AlgoConfig(critic=critic))
            pretrain_critic_on_demonstrations(trainer, train)
            values, returns = critic_values(trainer, held_out)
            adv = returns - values
            variances.append(float(adv.var()))
            mses.append(float((adv**2).mean()))
        spread = "/".join(f"{v:.4f}" for v in variances)
        print(
            f"| {steps} | {statistics.median(variances):.4f} ({spread}) | "
            f"{statistics.median(mses):.4f} | {returns.numel()} |",  # type: ignore[union-attr]
            flush=True,
        )
    assert returns is not None
    print(
        f"| constant (mean return {float(returns.mean()):.3f}) | {float(returns.var()):.4f} | "
        f"{float(returns.var()):.4f} | {returns.numel()} |"
    )


if __name__ == "__main__":
    main()
