"""A warm-started `small` policy on the quickstart's arithmetic task, cached on disk.

The MTP speculative-decoding and critic pre-training benchmarks both need a policy that
has learned the task's format (so its MTP head drafts well and its hidden states carry
the task): the quickstart's supervised warm start (demonstrations with a 30% slip rate,
content weight 1, MTP loss weight 0.1), run once and stored under `--cache`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from rlsys.config.algo import AlgoConfig
from rlsys.config.job import TrainerSection
from rlsys.config.model import ModelConfig, preset
from rlsys.config.sampling import SamplingConfig
from rlsys.model import Transformer
from rlsys.rollout.compaction import CompactionConfig
from rlsys.rollout.demos import make_demonstrations
from rlsys.rollout.scaffold import ScaffoldConfig
from rlsys.rollout.tasks.arithmetic import ArithmeticTask, ArithmeticTaskConfig
from rlsys.tokenizer import VOCAB_SIZE
from rlsys.trainer import Trainer, supervised_warm_start
from rlsys.trajectory import Trajectory

SCAFFOLD = ScaffoldConfig(
    max_turns=3,
    context_budget=384,
    sampling=SamplingConfig(max_tokens_per_turn=40),
    max_observation_tokens=32,
    compaction=CompactionConfig(max_compactions=0),
)
TASK = ArithmeticTaskConfig(min_factor=2, max_factor=9, max_addend=9, instructions=False)


def _no_sandbox():  # type: ignore[no-untyped-def]
    raise RuntimeError("the arithmetic task needs no sandbox")


@dataclass
class Warm:
    cfg: ModelConfig
    state: dict[str, torch.Tensor]
    task: ArithmeticTask


def demonstrations(task: ArithmeticTask, seed: int, n: int, slip_rate: float) -> list[Trajectory]:
    return make_demonstrations(task, seed, n, _no_sandbox, SCAFFOLD, slip_rate=slip_rate)


def trainer_for(model: Transformer, algo: AlgoConfig | None = None) -> Trainer:
    return Trainer(model, TrainerSection(), algo or AlgoConfig(), valid_vocab=VOCAB_SIZE)


def warm_small(steps: int, cache: Path, seed: int = 0) -> Warm:
    """The quickstart's warm start for `steps` steps (loaded from `cache` when present)."""
    cfg = preset("small")
    task = ArithmeticTask(TASK)
    path = cache / f"warm_small_{steps}_{seed}.pt"
    if path.exists():
        return Warm(cfg, torch.load(path), task)
    torch.manual_seed(seed)
    model = Transformer(cfg)
    started = time.perf_counter()
    nll = supervised_warm_start(
        model,
        demonstrations(task, seed, 1024, 0.3),
        steps=steps,
        lr=3e-3,
        batch_size=16,
        options=trainer_for(model).logprob_options,
        seed=seed,
        content_ids=task.content_token_ids,
        content_weight=1.0,
        mtp_weight=0.1,
    )
    print(
        f"warm start: {steps} steps, NLL {nll[0]:.3f} -> {nll[-1]:.3f}, "
        f"{time.perf_counter() - started:.0f}s",
        flush=True,
    )
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    cache.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)
    return Warm(cfg, state, task)
