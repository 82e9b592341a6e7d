"""Run a data-parallel `Trainer` in `world_size` real processes (torch.multiprocessing spawn).

Each rank joins a real process group (gloo on CPU, NCCL on CUDA), builds the same tiny
model from the same seed, is given the same trajectories, takes `steps` train steps and
writes its metrics and the gathered full state (`full_state_dict`) to `out/rank{r}.pt`.
Once every rank has written (a barrier), each destroys the group and leaves with
`os._exit(0)`, past the interpreter's finalization (see `_rank`).
"""

from __future__ import annotations

import faulthandler
import gc
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlsys.config.algo import AlgoConfig
from rlsys.config.job import TrainerSection
from rlsys.trainer import Trainer
from rlsys.trainer.data_parallel import DataParallel, init_data_parallel
from rlsys.trainer.fsdp import full_state_dict
from rlsys.trajectory import Trajectory
from tests.trainer.helpers import tiny_model

# Small micro-batches (several per rank); the MTP heads train (the tiny preset has one).
TRAINER = {"mtp_weight": 0.1, "mismatch_rollouts": 0, "micro_batch_tokens": 64}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class RankJob:
    """What every rank is given (pickled to each spawned process)."""

    device: str
    trajs: list[Trajectory]
    trainer_cfg: dict[str, Any]
    algo: AlgoConfig
    steps: int
    out: str
    restore_from: str | None
    save_to: str | None


def _rank(rank: int, world_size: int, port: int, job: RankJob) -> None:
    faulthandler.enable(all_threads=True)  # a native abort prints every thread's stack
    torch.set_num_threads(1)
    if job.device == "cuda":
        torch.cuda.set_device(rank)
    dp = init_data_parallel(job.device, f"tcp://127.0.0.1:{port}", rank, world_size, 60.0)
    try:
        _steps(rank, job, dp)
        dist.barrier()  # no rank tears its connections down while a peer still uses them
    finally:
        gc.collect()  # the sharded model's cycles, and the group they hold, go first
        dist.destroy_process_group()
    # The results are on disk. Skip interpreter finalization: a gloo group still referenced
    # from a dying object there can abort the process (SIGABRT, "terminate called without an
    # active exception") after a step that passed; exit code 0 tells the parent it did.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _steps(rank: int, job: RankJob, dp: DataParallel) -> None:
    model = tiny_model().to(job.device)
    cfg = TrainerSection.model_validate(job.trainer_cfg)
    trainer = Trainer(model, cfg, job.algo, data_parallel=dp)
    if job.restore_from is not None:
        trainer.restore(job.restore_from)
    metrics = [trainer.train_step(job.trajs).metrics.as_dict() for _ in range(job.steps)]
    state = full_state_dict(trainer.model)
    if job.save_to is not None:
        trainer.save_checkpoint(job.save_to)
    torch.save({"metrics": metrics, "state": state}, Path(job.out) / f"rank{rank}.pt")


def run_ranks(
    world_size: int,
    trajs: list[Trajectory],
    out: Path,
    *,
    device: str = "cpu",
    algo: AlgoConfig | None = None,
    steps: int = 2,
    restore_from: Path | None = None,
    save_to: Path | None = None,
    **trainer_cfg: Any,
) -> list[dict[str, Any]]:
    """Every rank's {"metrics": [per step], "state": full state dict} after `steps`
    (after restoring `restore_from` first; then saving a checkpoint to `save_to`)."""
    job = RankJob(
        device,
        trajs,
        {**TRAINER, **trainer_cfg},
        algo or AlgoConfig(),
        steps,
        str(out),
        str(restore_from) if restore_from is not None else None,
        str(save_to) if save_to is not None else None,
    )
    args = (world_size, free_port(), job)
    mp.start_processes(_rank, args=args, nprocs=world_size, join=True, start_method="spawn")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def single_rank(
    trajs: list[Trajectory],
    *,
    algo: AlgoConfig | None = None,
    steps: int = 2,
    device: str = "cpu",
    **trainer_cfg: Any,
) -> tuple[list[dict[str, Any]], dict[str, torch.Tensor]]:
    """The same steps on one unsharded trainer: (metrics per step, state dict on the CPU)."""
    torch.set_num_threads(1)
    trainer = Trainer(
        tiny_model().to(device),
        TrainerSection.model_validate({**TRAINER, **trainer_cfg}),
        algo or AlgoConfig(),
    )
    metrics = [trainer.train_step(trajs).metrics.as_dict() for _ in range(steps)]
    return metrics, {
        k: v.detach().to("cpu", copy=True) for k, v in trainer.model.state_dict().items()
    }
