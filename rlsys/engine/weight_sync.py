"""Collective weight broadcast, trainer -> engine replicas (the GPU path; gloo on CPU).

On one machine the Ray object store moves a state dict to every replica (the default
transport of `rlsys.actors`). On a GPU cluster that is a device -> host -> object store ->
host -> device copy per replica; the path designed here broadcasts straight from the
trainer's GPU to every replica's GPU with one NCCL collective per bucket:

- one process group, created when the job starts: the trainer is rank 0, replica r is rank
  r + 1 (a TCP rendezvous at the trainer's address; `torch.distributed` "nccl" on GPUs,
  "gloo" on CPUs, which is what CI runs);
- both sides derive the same `BucketPlan` from the state dict's names, shapes and dtypes
  (sorted names; tensors packed into flat buckets of at most `bucket_bytes`, one dtype per
  bucket), so nothing but the bucket payloads crosses the wire;
- every broadcast starts with a header (version, plan fingerprint, bucket count): a replica
  whose plan disagrees refuses the weights instead of loading garbage;
- replicas receive into staging buffers and swap them in between two engine steps (the
  engine's `update_weights`), so in-flight requests are not aborted and every token keeps
  the version that produced it;
- a replica that dies mid-broadcast breaks the collective for everyone: the controller
  times the broadcast out, drops the replica (admission migrates its sessions, as today)
  and rebuilds the group from the survivors before the next version.

Invariants: `receive` returns tensors bitwise equal to what `send` was given (same names,
shapes, dtypes); a header mismatch raises `WeightSyncError` before any payload is read.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

DEFAULT_BUCKET_BYTES = 64 << 20  # large enough to amortise launches, small enough to stage


class WeightSyncError(RuntimeError):
    """The sender and a receiver disagree on what is being broadcast."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class BucketPlan:
    """Which tensors go in which flat bucket, in order."""

    buckets: tuple[tuple[TensorSpec, ...], ...]

    @property
    def fingerprint(self) -> int:
        """A 62-bit digest of the plan: both sides must agree on it."""
        text = (
            ";".join(f"{s.name}:{s.shape}:{s.dtype}" for bucket in self.buckets for s in bucket)
            + f"|{len(self.buckets)}"
        )
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 2


def plan_buckets(
    specs: Mapping[str, Tensor] | list[TensorSpec], bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> BucketPlan:
    """Sorted names, grouped by dtype, packed greedily into buckets of <= `bucket_bytes`
    (a tensor larger than that gets a bucket of its own)."""
    if isinstance(specs, Mapping):
        specs = [TensorSpec(k, tuple(v.shape), v.dtype) for k, v in specs.items()]
    by_dtype: dict[str, list[TensorSpec]] = {}
    for s in sorted(specs, key=lambda s: s.name):
        by_dtype.setdefault(str(s.dtype), []).append(s)
    buckets: list[tuple[TensorSpec, ...]] = []
    for dtype_name in sorted(by_dtype):
        current: list[TensorSpec] = []
        size = 0
        for s in by_dtype[dtype_name]:
            nbytes = s.numel * torch.empty((), dtype=s.dtype).element_size()
            if current and size + nbytes > bucket_bytes:
                buckets.append(tuple(current))
                current, size = [], 0
            current.append(s)
            size += nbytes
        if current:
            buckets.append(tuple(current))
    return BucketPlan(tuple(buckets))


def _header(plan: BucketPlan, version: int, device: torch.device) -> Tensor:
    return torch.tensor([version, plan.fingerprint, len(plan.buckets)], dtype=torch.int64,
                        device=device)  # fmt: skip


def send(
    state: Mapping[str, Tensor],
    plan: BucketPlan,
    version: int,
    *,
    group: dist.ProcessGroup | None = None,
    src: int = 0,
) -> int:
    """Broadcast `state` as `version` from rank `src`; returns the payload bytes sent."""
    device = next(iter(state.values())).device
    dist.broadcast(_header(plan, version, device), src=src, group=group)
    sent = 0
    for bucket in plan.buckets:
        flat = torch.cat([state[s.name].detach().reshape(-1) for s in bucket])
        dist.broadcast(flat, src=src, group=group)
        sent += flat.numel() * flat.element_size()
    return sent


def receive(
    plan: BucketPlan,
    *,
    group: dist.ProcessGroup | None = None,
    src: int = 0,
    device: torch.device | str = "cpu",
) -> tuple[int, dict[str, Tensor]]:
    """Receive one broadcast into fresh buffers; returns (version, state dict)."""
    header = torch.zeros(3, dtype=torch.int64, device=device)
    dist.broadcast(header, src=src, group=group)
    version, fingerprint, count = (int(x) for x in header.tolist())
    if fingerprint != plan.fingerprint or count != len(plan.buckets):
        raise WeightSyncError(
            f"weights v{version}: the sender's plan ({count} buckets, fingerprint "
            f"{fingerprint:x}) differs from this replica's ({len(plan.buckets)} buckets, "
            f"fingerprint {plan.fingerprint:x}); the model configs disagree"
        )
    state: dict[str, Tensor] = {}
    for bucket in plan.buckets:
        flat = torch.empty(sum(s.numel for s in bucket), dtype=bucket[0].dtype, device=device)
        dist.broadcast(flat, src=src, group=group)
        offset = 0
        for s in bucket:
            state[s.name] = flat[offset : offset + s.numel].view(s.shape).clone()
            offset += s.numel
    return version, state
