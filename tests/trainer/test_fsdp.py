"""FSDP2 data parallel on CPU (gloo, 2 real processes): the same step as one rank."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from rlsys.config.algo import AlgoConfig, CriticConfig
from rlsys.config.job import JobConfig
from rlsys.trainer import load_checkpoint
from rlsys.trainer.batch import micro_batches
from rlsys.trainer.data_parallel import assign_micro_batches
from rlsys.trainer.fsdp import shard_policy
from tests.trainer.dp_harness import TRAINER, run_ranks, single_rank
from tests.trainer.helpers import engine_trajectories, tiny_model

pytestmark = pytest.mark.unit

METRICS = ("loss", "pg_loss", "num_tokens", "num_policy_tokens", "grad_norm", "entropy")


def _trajectories() -> list:  # type: ignore[type-arg]
    # 3 groups of 2, 2 turns each: ~6 micro-batches of <= 64 rows, of unequal sizes
    return engine_trajectories(tiny_model(), groups=3, group_size=2, turns=2)


Json = dict[str, Any]


def _assert_same_step(
    ranks: list[Json], ref_metrics: list[Json], ref_state: dict[str, torch.Tensor]
) -> None:
    for out in ranks:
        assert out["state"].keys() == ref_state.keys()
        for key, ref in ref_state.items():
            got = out["state"][key]
            assert got.shape == ref.shape and got.dtype == ref.dtype, key
            torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7, msg=key)
        for got, ref in zip(out["metrics"], ref_metrics, strict=True):
            for name in METRICS:
                assert got[name] == pytest.approx(ref[name], rel=1e-6, abs=1e-9), name


def test_two_ranks_take_the_single_rank_step(tmp_path: Path) -> None:
    trajs = _trajectories()
    sizes = [
        sum(len(s.token_ids) for _, s, _ in mb)
        for mb in micro_batches(trajs, TRAINER["micro_batch_tokens"])
    ]
    assert len(sizes) >= 3  # both ranks have work; one has a padding pass when odd
    ref_metrics, ref_state = single_rank(trajs)
    ranks = run_ranks(2, trajs, tmp_path)
    _assert_same_step(ranks, ref_metrics, ref_state)
    # the step moved the weights: equality is not two untouched models
    assert not torch.equal(ranks[0]["state"]["lm_head"], tiny_model().state_dict()["lm_head"])


def test_rank_zero_measures_the_stale_mismatch_as_one_rank_does(tmp_path: Path) -> None:
    trajs = _trajectories()  # sampled by version 0: stale at the second step
    ref_metrics, ref_state = single_rank(trajs, mismatch_rollouts=2)
    ranks = run_ranks(2, trajs, tmp_path, mismatch_rollouts=2)
    _assert_same_step(ranks, ref_metrics, ref_state)
    want = ref_metrics[1]["mismatch"]
    assert want["tokens"] > 0
    got = ranks[0]["metrics"][1]["mismatch"]
    assert got["tokens"] == want["tokens"]
    assert got["mean_abs"] == pytest.approx(want["mean_abs"], rel=1e-5, abs=1e-9)


def test_critic_and_reference_policy_match_the_single_rank_step(tmp_path: Path) -> None:
    trajs = _trajectories()
    # the critic's baseline is used from the second step (warmup_updates 1), the KL to a
    # reference taken at the first step enters both
    algo = AlgoConfig(kl_coef=0.1, critic=CriticConfig(enabled=True, warmup_updates=1))
    ref_metrics, ref_state = single_rank(trajs, algo=algo)
    ranks = run_ranks(2, trajs, tmp_path, algo=algo)
    _assert_same_step(ranks, ref_metrics, ref_state)
    for name in ("kl", "critic_loss"):
        assert ranks[0]["metrics"][1][name] == pytest.approx(ref_metrics[1][name], rel=1e-5)
    assert ranks[0]["metrics"][1]["critic_baseline"] and ref_metrics[1]["kl_source"] == "reference"


def test_seq_mean_and_ppo_clip_match_the_single_rank_step(tmp_path: Path) -> None:
    trajs = _trajectories()
    algo = AlgoConfig(objective="ppo_clip", aggregation="seq_mean")
    ref_metrics, ref_state = single_rank(trajs, algo=algo, steps=1)
    ranks = run_ranks(2, trajs, tmp_path, algo=algo, steps=1)
    _assert_same_step(ranks, ref_metrics, ref_state)


def test_a_sharded_checkpoint_resumes_into_the_single_rank_run(tmp_path: Path) -> None:
    trajs = _trajectories()
    ref_metrics, ref_state = single_rank(trajs, steps=2)
    ckpt = tmp_path / "ckpt.pt"
    first = run_ranks(2, trajs, tmp_path, steps=1, save_to=ckpt)
    saved = load_checkpoint(ckpt)  # rank 0 wrote full tensors under the unsharded names
    assert saved["model"].keys() == ref_state.keys() and saved["step"] == 1
    for key, value in first[0]["state"].items():
        assert torch.equal(saved["model"][key], value), key
    resumed = run_ranks(2, trajs, tmp_path, steps=1, restore_from=ckpt)
    # the optimiser's moments came back too: step 2 lands where the single rank's did
    _assert_same_step(resumed, ref_metrics[1:], ref_state)


def test_micro_batches_are_shared_by_token_count_deterministically() -> None:
    assert assign_micro_batches([10, 50, 20, 40, 30], 2) == [[0, 1, 2], [3, 4]]
    assert assign_micro_batches([5], 3) == [[0], [], []]
    shares = assign_micro_batches([7, 7, 7, 7], 2)
    assert shares == [[0, 2], [1, 3]]


@pytest.mark.parametrize(
    ("section", "field", "value", "message"),
    [
        ("trainer", "num_gpus", 2, "trainer.num_gpus must be 1 or 0"),
        ("engine", "weight_transport", "collective", "engine.weight_transport must be"),
    ],
)
def test_config_refuses_what_does_not_run_sharded(
    section: str, field: str, value: object, message: str
) -> None:
    cfg: Json = {"model": {"preset": "tiny"}, "trainer": {**TRAINER, "data_parallel": 2}}
    cfg.setdefault(section, {})[field] = value
    with pytest.raises(ValidationError, match=message.replace(".", r"\.")):
        JobConfig.model_validate(cfg)
    cfg["trainer"]["data_parallel"] = 1  # the same job on one rank is fine
    JobConfig.model_validate(cfg)


def test_config_accepts_data_parallel_on_cpus_and_on_one_gpu_per_rank() -> None:
    for gpus in (0, 1):
        trainer = {**TRAINER, "data_parallel": 4, "num_gpus": gpus}
        cfg = JobConfig.model_validate({"model": {"preset": "tiny"}, "trainer": trainer})
        assert cfg.trainer.data_parallel == 4


def test_only_the_native_model_is_sharded() -> None:
    hf = {
        "model": {"kind": "hf", "path": "/models/tiny"},
        "engine": {"backend": "vllm"},
        "trainer": {**TRAINER, "data_parallel": 2},
    }
    with pytest.raises(ValidationError, match=r"model\.kind must be native"):
        JobConfig.model_validate(hf)
    with pytest.raises(ValueError, match=r"model\.kind"):  # before any collective
        shard_policy(torch.nn.Linear(2, 2), None)  # type: ignore[arg-type]
