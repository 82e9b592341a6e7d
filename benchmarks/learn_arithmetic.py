"""Learning check: RL on the arithmetic tool-use task raises mean reward (CPU, `small` model).

Loop: supervised warm start on synthetic demonstrations, then per step: G groups of S
rollouts (one task instance per group) run concurrently through the real scaffold against
the real `InferenceEngine` (staleness 0: the engine gets the new weights after each step),
then one `Trainer.train_step`. Prints one row per step, and the mean reward of a fixed
held-out evaluation set before and after RL.

Usage:
  python benchmarks/learn_arithmetic.py [--steps 10] [--groups 4] [--group-size 8]
      [--warm-steps 40] [--zero-center on|off] [--threads 2] [--seed 0]
      [--max-factor 9] [--max-addend 9]   (operand ranges; the task's default is 99/99)
      [--content-weight 1.0] [--instructions on|off]   (warm-start loss; prompt)
      [--slip-rate 0.0]   (share of demonstrations in which the demonstrator errs)
      [--device cpu|cuda]   (where the engine and the trainer run)
      [--json PATH]   (also write the result as JSON: what tests/trainer/test_learning.py reads)
"""

from __future__ import annotations

import argparse
import json
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlsys.config.algo import AlgoConfig
from rlsys.config.engine import EngineConfig
from rlsys.config.job import TrainerSection
from rlsys.config.model import preset
from rlsys.config.sampling import SamplingConfig
from rlsys.engine.engine import InferenceEngine
from rlsys.model import Transformer
from rlsys.rollout.compaction import CompactionConfig
from rlsys.rollout.demos import make_demonstrations
from rlsys.rollout.events import NullEventSink
from rlsys.rollout.scaffold import RolloutOutcome, ScaffoldConfig, run_rollout
from rlsys.rollout.tasks.arithmetic import ArithmeticTask, ArithmeticTaskConfig
from rlsys.trainer import Trainer, supervised_warm_start
from rlsys.trainer.warm_start import LR_SCHEDULES
from rlsys.trajectory import Trajectory

SCAFFOLD = ScaffoldConfig(
    max_turns=3,
    context_budget=384,
    sampling=SamplingConfig(max_tokens_per_turn=40),
    max_observation_tokens=32,
    compaction=CompactionConfig(max_compactions=0),
)


def no_sandbox():  # type: ignore[no-untyped-def]
    raise RuntimeError("the arithmetic task needs no sandbox")


@dataclass
class Batch:
    trajectories: list[Trajectory]  # scored rollouts (failed ones excluded)
    rewards: list[float]  # every rollout, a failed one as 0
    failed: int
    generate_s: float


def collect(
    engine: InferenceEngine,
    task: ArithmeticTask,
    indices: list[int],
    group_size: int,
    tag: str,
    scaffold: ScaffoldConfig = SCAFFOLD,
) -> Batch:
    """G = len(indices) groups of `group_size` rollouts, all in flight at once."""
    jobs = [(g, i, m) for g, i in enumerate(indices) for m in range(group_size)]

    def one(job: tuple[int, int, int]) -> RolloutOutcome:
        g, index, m = job
        return run_rollout(
            task,
            index,
            engine,
            config=scaffold,
            sink=NullEventSink(),
            open_sandbox=no_sandbox,
            rollout_id=f"{tag}-{g}-{m}",
            group_id=f"{tag}-{g}",
        )

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        outcomes = list(pool.map(one, jobs))
    ok = [o.trajectory for o in outcomes if o.failure is None]
    rewards = [o.trajectory.reward if o.failure is None else 0.0 for o in outcomes]
    return Batch(ok, rewards, len(outcomes) - len(ok), time.perf_counter() - started)


def evaluate(engine: InferenceEngine, task: ArithmeticTask, n: int, seed: int) -> float:
    rng = random.Random(f"eval:{seed}")
    indices = [10**9 + rng.randrange(10**6) for _ in range(n)]
    return sum(collect(engine, task, indices, 1, "eval").rewards) / n


@dataclass
class WarmStart:
    state: dict[str, torch.Tensor]  # the warm-started policy's weights
    task: ArithmeticTask
    nll_first: float
    nll_last: float
    seconds: float


def warm_start(args: argparse.Namespace) -> WarmStart:
    """The supervised warm start on demonstrations (a share `--slip-rate` of them wrong),
    with the zero-center projection as `--zero-center` says."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    model = Transformer(preset(args.preset)).to(args.device)
    task = ArithmeticTask(
        ArithmeticTaskConfig(
            max_factor=args.max_factor,
            max_addend=args.max_addend,
            instructions=args.instructions == "on",
        )
    )
    options = _trainer(model, args, args.zero_center).logprob_options
    started = time.perf_counter()
    demos = make_demonstrations(
        task, args.seed, args.demos, no_sandbox, SCAFFOLD, slip_rate=args.slip_rate
    )
    nll = supervised_warm_start(
        model,
        demos,
        steps=args.warm_steps,
        lr=args.warm_lr,
        batch_size=args.warm_batch,
        options=options,
        seed=args.seed,
        content_ids=task.content_token_ids,
        content_weight=args.content_weight,
        lr_schedule=args.warm_schedule,
        mtp_weight=args.mtp_weight,
    )
    seconds = time.perf_counter() - started
    print(
        f"warm start: {args.warm_steps} steps on {len(demos)} demonstrations "
        f"(slip rate {args.slip_rate}), NLL {nll[0]:.3f} -> {nll[-1]:.3f}, {seconds:.0f}s",
        flush=True,
    )
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return WarmStart(state, task, nll[0], nll[-1], seconds)


def _trainer(model: Transformer, args: argparse.Namespace, zero_center: str) -> Trainer:
    cfg = TrainerSection(
        lr=args.lr,
        warmup_steps=args.warmup,
        zero_center=zero_center == "on",
        mtp_weight=args.mtp_weight,
    )
    return Trainer(model, cfg, AlgoConfig(max_staleness=0))


def reinforce(
    args: argparse.Namespace, warm: WarmStart, zero_center: str, before: float | None = None
) -> dict[str, Any]:
    """RL from the warm-started weights (a fresh model, trainer and engine each call, so
    two calls from one warm start compare like with like). `before`: the warm start's
    evaluation, when a previous call already measured it (it is deterministic)."""
    torch.set_num_threads(args.threads)
    model = Transformer(preset(args.preset))
    model.load_state_dict(warm.state)
    model = model.to(args.device)
    trainer = _trainer(model, args, zero_center)
    task = warm.task
    engine_cfg = EngineConfig(
        max_running=64,
        max_context_tokens=SCAFFOLD.context_budget,
        seed=args.seed,
        device=args.device,
    )
    rng = random.Random(f"train:{args.seed}")
    with InferenceEngine(model.cfg, engine_cfg, model.state_dict(), trainer.version) as engine:
        if before is None:
            before = evaluate(engine, task, args.eval, args.seed)
        print(f"eval reward before RL: {before:.3f} ({args.eval} rollouts)", flush=True)
        print(
            f"RL, zero-center {zero_center}:\n"
            "| step | reward mean | failed | samples | loss | entropy | drift max | gen s | train s |"
        )
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        rl_started = time.perf_counter()
        curve = []
        for step in range(args.steps):
            indices = [rng.randrange(10**9) for _ in range(args.groups)]
            batch = collect(engine, task, indices, args.group_size, f"s{step}")
            result = trainer.train_step(batch.trajectories)
            engine.update_weights(model.state_dict(), trainer.version)
            m = result.metrics
            reward = sum(batch.rewards) / len(batch.rewards)
            curve.append(reward)
            print(
                f"| {step} | {reward:.3f} | {batch.failed} | {m.num_samples} | {m.loss:.4f} "
                f"| {m.entropy:.3f} | {m.logprob_drift_max_abs:.2e} | {batch.generate_s:.1f} "
                f"| {m.step_s:.1f} |",
                flush=True,
            )
        rl_s = time.perf_counter() - rl_started
        after = evaluate(engine, task, args.eval, args.seed)
    print(f"eval reward after RL: {after:.3f}; RL wall time {rl_s:.0f}s ({args.steps} steps)")
    return {"before": before, "after": after, "rl_s": rl_s, "warm_s": warm.seconds, "curve": curve}


def run(args: argparse.Namespace) -> dict[str, Any]:
    return reinforce(args, warm_start(args), args.zero_center)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-factor", type=int, default=9, help="largest a and b of a*b+c")
    p.add_argument("--max-addend", type=int, default=9, help="largest c of a*b+c")
    p.add_argument("--demos", type=int, default=1024)
    p.add_argument("--warm-steps", type=int, default=40)
    p.add_argument("--warm-lr", type=float, default=3e-3)
    p.add_argument("--warm-batch", type=int, default=16, help="demonstrations per warm step")
    p.add_argument("--warm-schedule", choices=sorted(LR_SCHEDULES), default="stable_decay")
    p.add_argument("--instructions", choices=["on", "off"], default="off")
    p.add_argument("--content-weight", type=float, default=1.0)
    p.add_argument("--slip-rate", type=float, default=0.0, help="share of wrong demonstrations")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=10, help="RL learning-rate warm-up steps")
    p.add_argument("--zero-center", choices=["on", "off"], default="on")
    p.add_argument(
        "--mtp-weight", type=float, default=0.1, help="MTP heads' loss weight (0: no heads' loss)"
    )
    p.add_argument("--eval", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--preset", default="small", help="model preset (rlsys.config.model)")
    p.add_argument("--device", default="cpu", help="engine and trainer device (cpu, cuda)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the result (before, after, ...) here")
    return p


if __name__ == "__main__":
    _args = parser().parse_args()
    _result = run(_args)
    if _args.json:
        Path(_args.json).write_text(json.dumps(_result))
