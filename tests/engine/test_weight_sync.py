"""Collective weight broadcast (the GPU path, run here on gloo): what the replicas receive
is bitwise what the trainer sent, version by version; mismatched plans are refused."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlsys.config.model import preset
from rlsys.engine.weight_sync import WeightSyncError, plan_buckets, receive, send
from rlsys.model import Transformer

pytestmark = pytest.mark.unit

WORLD = 3  # the trainer and two replicas


def _state(version: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(version)
    state = dict(Transformer(preset("tiny")).state_dict())
    state["extra.bf16"] = torch.randn(5, 3).to(torch.bfloat16)  # a second dtype, own bucket
    return state


def _rank_main(rank: int, root: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{root}/rendezvous", rank=rank, world_size=WORLD,
        timeout=timedelta(seconds=60),
    )  # fmt: skip
    try:
        plan = plan_buckets(_state(0), bucket_bytes=64 << 10)  # small: many buckets
        for version in (1, 2):
            if rank == 0:
                send(_state(version), plan, version)
            else:
                got_version, state = receive(plan)
                torch.save((got_version, state), Path(root) / f"rank{rank}-v{version}.pt")
    finally:
        dist.destroy_process_group()


def test_replicas_receive_the_trainers_weights_bitwise(tmp_path: Path) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(_rank_main, args=(str(tmp_path),), nprocs=WORLD, join=True)
    for version in (1, 2):
        sent = _state(version)
        for rank in (1, 2):
            got_version, got = torch.load(tmp_path / f"rank{rank}-v{version}.pt")
            assert got_version == version and got.keys() == sent.keys()
            for name, tensor in sent.items():
                assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape
                assert torch.equal(
                    got[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)
                )


def test_plans_are_deterministic_bucketed_and_fingerprint_the_model() -> None:
    state = _state(0)
    small = plan_buckets(state, bucket_bytes=64 << 10)
    assert small == plan_buckets(dict(reversed(list(state.items()))), bucket_bytes=64 << 10)
    assert len(small.buckets) > 1
    assert all(len({s.dtype for s in b}) == 1 for b in small.buckets)
    assert {s.name for b in small.buckets for s in b} == set(state)
    other = dict(state)
    other["extra.bf16"] = torch.zeros(5, 4, dtype=torch.bfloat16)
    assert plan_buckets(other, bucket_bytes=64 << 10).fingerprint != small.fingerprint
    assert issubclass(WeightSyncError, RuntimeError)
