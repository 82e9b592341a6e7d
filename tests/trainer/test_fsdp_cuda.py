"""FSDP2 data parallel on CUDA (NCCL): every visible GPU a rank, the single-GPU step.

World size: all visible GPUs (one is enough: a one-rank mesh still shards, gathers and
reduces through NCCL). Runs with plain `python -m pytest tests/trainer/test_fsdp_cuda.py`
with torch and pydantic only.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.trainer.dp_harness import run_ranks, single_rank
from tests.trainer.helpers import engine_trajectories, tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_every_gpu_a_rank_takes_the_single_gpu_step(tmp_path: Path) -> None:
    world_size = torch.cuda.device_count()
    trajs = engine_trajectories(tiny_model(), groups=4, group_size=2, turns=2)
    ref_metrics, ref_state = single_rank(trajs, device="cuda")
    ranks = run_ranks(world_size, trajs, tmp_path, device="cuda")
    for out in ranks:
        assert out["state"].keys() == ref_state.keys()
        for key, ref in ref_state.items():
            got = out["state"][key]
            assert got.device.type == "cpu" and got.dtype == ref.dtype, key
            # cuBLAS and NCCL sum in other orders than one GPU: close, not bitwise
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6, msg=key)
        for got, ref in zip(out["metrics"], ref_metrics, strict=True):
            for name in ("loss", "num_tokens", "num_policy_tokens", "grad_norm"):
                assert got[name] == pytest.approx(ref[name], rel=1e-5, abs=1e-8), name
