"""The broadcast group's generations (no Ray): members join, the trainer broadcasts, a
member dies, the survivors re-form a smaller group on a fresh port and broadcast again.
gloo on CPU here; with two or more GPUs the same test runs over NCCL (one GPU per rank)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlsys.engine.sync_group import GroupMember, Rendezvous
from rlsys.engine.weight_sync import plan_buckets, receive, send

pytestmark = pytest.mark.unit

TIMEOUT_S = 30.0


def _state(version: int, device: str) -> dict[str, torch.Tensor]:
    # Drawn on the CPU, then moved: a CUDA generator gives other numbers for the same seed,
    # which is what made the NCCL variant compare the received weights with other values.
    g = torch.Generator().manual_seed(version)
    return {
        "a": torch.randn(7, 5, generator=g).to(device),
        "b": torch.randn(3, generator=g).to(device),
    }


def _device(backend: str, rank: int) -> str:
    return f"cuda:{rank}" if backend == "nccl" else "cpu"


def _member_main(rank: int, backend: str, world: int, queue: mp.Queue, root: str) -> None:
    device = _device(backend, rank)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    member = GroupMember()
    plan = plan_buckets(_state(0, "cpu"))
    for generation, size in ((1, world), (2, world - 1)):
        if rank >= size:  # the last rank "dies" after generation 1
            return
        if rank == 0:
            rdv = member.listen("127.0.0.1", size, generation, backend, TIMEOUT_S)
            for _ in range(size - 1):
                queue.put(rdv)
        else:
            rdv = queue.get(timeout=TIMEOUT_S)
            assert isinstance(rdv, Rendezvous) and rdv.generation == generation
        member.join(rdv, rank)
        assert member.generation == generation and dist.get_world_size() == size
        if rank == 0:
            send(_state(generation, device), plan, generation)
        else:
            version, state = receive(plan, device=device)
            torch.save((version, {k: v.cpu() for k, v in state.items()}),
                       Path(root) / f"g{generation}-r{rank}.pt")  # fmt: skip
        member.leave()
        member.leave()  # idempotent
        assert not dist.is_initialized()


def _run(backend: str, world: int, root: Path) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    queue = mp.get_context("spawn").Queue()
    mp.spawn(_member_main, args=(backend, world, queue, str(root)), nprocs=world, join=True)
    for generation, size in ((1, world), (2, world - 1)):
        sent = _state(generation, "cpu")
        for rank in range(1, size):
            version, got = torch.load(root / f"g{generation}-r{rank}.pt")
            assert version == generation
            assert all(torch.equal(got[k], sent[k]) for k in sent)
        assert not (root / f"g{generation}-r{size}.pt").exists()


def test_gloo_group_reforms_without_a_dead_member(tmp_path: Path) -> None:
    _run("gloo", 3, tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL: one per rank)")
def test_nccl_group_reforms_without_a_dead_member(tmp_path: Path) -> None:
    _run("nccl", min(3, torch.cuda.device_count()), tmp_path)
