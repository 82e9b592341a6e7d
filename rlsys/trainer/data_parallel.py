"""Data-parallel SPMD for the trainer: which micro-batches a rank runs, and the reductions.

Every rank is given the same full list of trajectories for a step and packs the same
micro-batches (`micro_batches`, deterministic given the list). Each rank then runs its
share (`assign_micro_batches`: balanced by token count, deterministic), while every
normalisation (token weights, `aux_scale`, group-relative advantages) is computed over the
whole list, so the step's loss is the single-rank loss split into per-rank terms and the
summed gradient (FSDP's reduce-scatter, divide factor 1) is the single-rank gradient.

Invariants:
- Every rank runs the same number of forward/backward passes (FSDP's all-gathers and
  reduce-scatters are collectives): a rank with fewer micro-batches adds padding passes
  whose loss is multiplied by zero and whose statistics (MoE load, clamp counters) are
  restored (`preserved_statistics`), so a padding pass changes nothing but the clock.
- After `reduce_token_sums` and `reduce_expert_load` every rank holds the global numbers:
  sums are summed, maxima maxed; the MoE selection bias then moves identically on all.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from rlsys.model.grad_clamp import GradClamp
from rlsys.model.moe import MoE
from rlsys.trainer.metrics import TokenSums

_SUMMED = (
    "tokens",
    "loss",
    "pg",
    "kl",
    "critic",
    "entropy",
    "weight",
    "clipped",
    "drift_abs",
    "behaviour_k3",
    "mismatch_tokens",
    "mismatch_abs",
    "mismatch_k3",
)
_MAXED = ("drift_max", "mismatch_max")


@dataclass(frozen=True)
class DataParallel:
    """This process's place in the trainer's data-parallel group (a 1-D device mesh)."""

    mesh: DeviceMesh

    @property
    def rank(self) -> int:
        return self.mesh.get_local_rank()

    @property
    def world_size(self) -> int:
        return self.mesh.size()

    @property
    def group(self) -> dist.ProcessGroup:
        return self.mesh.get_group()


def init_data_parallel(
    device_type: str, init_method: str, rank: int, world_size: int, timeout_s: float
) -> DataParallel:
    """Join the trainer's process group (NCCL on CUDA, gloo on CPU) and build its mesh.

    `timeout_s` bounds every collective: a dead rank makes the others raise, not hang."""
    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    return DataParallel(init_device_mesh(device_type, (world_size,)))


def assign_micro_batches(num_tokens: list[int], world_size: int) -> list[list[int]]:
    """Micro-batch indices per rank: largest first to the least-loaded rank (ties: fewer
    micro-batches, then the lower rank); each rank's list in the original order."""
    shares: list[list[int]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for i in sorted(range(len(num_tokens)), key=lambda i: (-num_tokens[i], i)):
        rank = min(range(world_size), key=lambda r: (load[r], len(shares[r]), r))
        shares[rank].append(i)
        load[rank] += num_tokens[i]
    return [sorted(s) for s in shares]


def reduce_token_sums(sums: TokenSums, group: dist.ProcessGroup) -> None:
    """Every rank's `sums` becomes the sums over all ranks (maxima: the max)."""
    sums.settle()
    device = _device(group)
    summed = torch.tensor([float(getattr(sums, f)) for f in _SUMMED], dtype=torch.float64)
    maxed = torch.tensor([float(getattr(sums, f)) for f in _MAXED], dtype=torch.float64)
    summed, maxed = summed.to(device), maxed.to(device)
    dist.all_reduce(summed, op=dist.ReduceOp.SUM, group=group)
    dist.all_reduce(maxed, op=dist.ReduceOp.MAX, group=group)
    for name, value in zip(_SUMMED, summed.cpu().tolist(), strict=True):
        setattr(sums, name, int(value) if name.endswith("tokens") else value)
    for name, value in zip(_MAXED, maxed.cpu().tolist(), strict=True):
        setattr(sums, name, value)


def reduce_count(count: int, group: dist.ProcessGroup) -> int:
    total = torch.tensor([count], dtype=torch.int64, device=_device(group))
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return int(total.item())


def reduce_gradients(module: nn.Module, group: dist.ProcessGroup) -> None:
    """Sum a replicated (unsharded) module's gradients over ranks, e.g. the critic's."""
    for p in module.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=group)


def reduce_expert_load(model: nn.Module, group: dist.ProcessGroup) -> None:
    """Sum each MoE layer's expert load over ranks (before `update_balance`)."""
    for module in model.modules():
        if isinstance(module, MoE):
            # on the parameters' device: host for gloo, the GPU for NCCL
            dist.all_reduce(module.expert_load, op=dist.ReduceOp.SUM, group=group)


def _device(group: dist.ProcessGroup) -> torch.device:
    """Where a small reduction's tensor must live: NCCL reduces device tensors only."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@contextmanager
def preserved_statistics(model: nn.Module) -> Iterator[None]:
    """Restore the MoE load and gradient-clamp counters a padding pass would add to."""
    buffers = [
        b
        for m in model.modules()
        if isinstance(m, MoE | GradClamp)
        for b in ([m.expert_load] if isinstance(m, MoE) else [m.counters])
    ]
    saved = [b.clone() for b in buffers]
    try:
        yield
    finally:
        for b, s in zip(buffers, saved, strict=True):
            b.copy_(s)
