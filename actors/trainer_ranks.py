"""The trainer's data-parallel ranks 1..N-1 (`trainer.data_parallel` > 1), driven by rank 0.

The `TrainerActor` is rank 0: it alone reads the stream, answers the controller and
publishes weights. It starts N - 1 `TrainerRank` actors (each with the trainer's
`num_cpus`, `num_gpus` and `resources`, placed by Ray), which join one torch.distributed
group with it (NCCL on GPUs, gloo on CPUs; rank 0 hosts the rendezvous) and build the same
model and `Trainer` from the same seed. Every call that touches the sharded policy (a
step, a full-state gather, a checkpoint save or restore, a warm-start load) is run by
`RankGroup.collective`: the followers' calls are sent first, then rank 0 runs its own.

Invariants:
- Rank 0 and the followers call the policy's collectives in the same order (each a Ray
  actor runs one call at a time, in submission order), with the same arguments.
- A dead or hung rank never hangs the trainer: every collective is bounded by
  `trainer.data_parallel_timeout_s`, and any failure of a collective call ends rank 0's
  process (`os._exit`), so the controller sees the trainer die and restarts it from its
  checkpoint; the followers are owned by rank 0 and die with it.
"""

from __future__ import annotations

import os
import socket
import sys
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import ray

from rlsys.config.job import JobConfig

if TYPE_CHECKING:  # torch is imported inside the actors' processes only
    from torch import Tensor

    from rlsys.trainer.data_parallel import DataParallel
    from rlsys.trainer.trainer import Trainer
    from rlsys.trajectory import Trajectory

T = TypeVar("T")


def build_trainer(cfg: JobConfig, data_parallel: DataParallel | None) -> Trainer:
    """The model and `Trainer` of one rank (every rank builds the same from the seed)."""
    import torch

    from rlsys.model.policy import build_policy
    from rlsys.tokenizer import VOCAB_SIZE
    from rlsys.trainer.trainer import Trainer

    torch.manual_seed(cfg.seed)
    model = build_policy(cfg.model)  # model.kind: native or hf
    if cfg.trainer.num_gpus > 0:  # Ray set CUDA_VISIBLE_DEVICES to this actor's GPU
        model = model.to("cuda")
    return Trainer(
        model,
        cfg.trainer,
        cfg.algo,
        temperature=cfg.sampling.temperature,
        valid_vocab=VOCAB_SIZE,  # the engine samples only tokenizer ids (sample_vocab)
        data_parallel=data_parallel,
    )


def join_group(cfg: JobConfig, init_method: str, rank: int) -> DataParallel:
    from rlsys.trainer.data_parallel import init_data_parallel

    device = "cuda" if cfg.trainer.num_gpus > 0 else "cpu"
    return init_data_parallel(
        device, init_method, rank, cfg.trainer.data_parallel, cfg.trainer.data_parallel_timeout_s
    )


@ray.remote(max_restarts=0)
class TrainerRank:
    """Rank `rank` > 0: holds a shard, runs what rank 0 runs, returns nothing it holds."""

    def __init__(self, cfg: JobConfig, rank: int, init_method: str, checkpoint: str | None) -> None:
        import torch

        torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
        self.trainer = build_trainer(cfg, join_group(cfg, init_method, rank))
        if checkpoint is not None:
            self.trainer.restore(checkpoint)

    def train_step(self, trajectories: list[Trajectory]) -> None:
        self.trainer.train_step(trajectories)

    def pretrain_critic(self, demonstrations: list[Trajectory]) -> None:
        from rlsys.trainer.critic_pretrain import pretrain_critic_on_demonstrations

        pretrain_critic_on_demonstrations(self.trainer, demonstrations)

    def gather(self) -> None:
        from rlsys.trainer.fsdp import full_state_dict

        full_state_dict(self.trainer.model)

    def load_full(self, state: dict[str, Tensor]) -> None:
        from rlsys.trainer.fsdp import load_full_state_dict

        load_full_state_dict(self.trainer.model, state)

    def checkpoint(self, path: str) -> None:
        self.trainer.save_checkpoint(path)

    def set_position(self, step: int, version: int) -> None:
        self.trainer.step, self.trainer.version = step, version


class RankGroup:
    """Rank 0's handle on its followers; `join` makes this process rank 0."""

    def __init__(self, cfg: JobConfig, checkpoint: str | None) -> None:
        from ray.util import get_node_ip_address

        self.timeout_s = cfg.trainer.data_parallel_timeout_s
        host = get_node_ip_address()
        self.init_method = f"tcp://{host}:{_free_port(host)}"
        options = {
            "num_cpus": cfg.trainer.num_cpus,
            "num_gpus": cfg.trainer.num_gpus,
            "resources": cfg.trainer.resources,
        }
        start = TrainerRank.options(**options).remote  # type: ignore[attr-defined]
        self.followers = [
            start(cfg, rank, self.init_method, checkpoint)
            for rank in range(1, cfg.trainer.data_parallel)
        ]

    def collective(self, method: str, args: tuple[object, ...], local: Callable[[], T]) -> T:
        """`method(*args)` on every follower and `local()` here, together; rank 0's result.

        Any failure (a rank died, a collective timed out) ends this process: see above."""
        try:
            refs = [getattr(f, method).remote(*args) for f in self.followers]
            out = local()
            # the followers finish the same collectives: a short grace beyond their bound
            ray.get(refs, timeout=self.timeout_s + 30)
            return out
        except Exception:  # noqa: BLE001 - every failure here leaves the group unusable
            die("a trainer rank failed in a collective")
            raise  # unreachable

    def each(self, method: str, *args: object) -> None:
        """A call without collectives (bookkeeping) on every follower."""
        try:
            ray.get([getattr(f, method).remote(*args) for f in self.followers], timeout=60)
        except Exception:  # noqa: BLE001
            die(f"a trainer rank failed in {method}")


def die(why: str) -> None:
    """End the trainer's process loudly: the controller restarts it from its checkpoint,
    which is the only safe way back once the ranks disagree on where they are."""
    print(f"rlsys trainer: {why}; exiting\n{traceback.format_exc()}", file=sys.stderr, flush=True)
    os._exit(1)


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
