"""The engine's one configuration is the job's `engine` section (docs/ARCHITECTURE.md,
"Configuration"): placement as a sub-model, device and TP backend following it, the
job's seed, and the replica's copy of the section."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rlsys.config.engine import EngineConfig, EnginePlacement
from rlsys.config.job import JobConfig

pytestmark = pytest.mark.unit


def test_the_job_section_is_the_engine_configuration() -> None:
    job = JobConfig.model_validate({"engine": {"max_running": 8, "candidate_cap": 16}})
    assert type(job.engine) is EngineConfig
    assert job.engine.max_running == 8 and job.engine.candidate_cap == 16


def test_flat_placement_keys_are_the_nested_sub_model() -> None:
    flat = EngineConfig.model_validate({"replicas": 3, "num_gpus": 1, "resources": {"a": 1}})
    nested = EngineConfig.model_validate(
        {"placement": {"replicas": 3, "num_gpus": 1, "resources": {"a": 1}}}
    )
    assert flat == nested
    assert flat.placement == EnginePlacement(replicas=3, num_gpus=1, resources={"a": 1})
    with pytest.raises(ValidationError, match="engine.replicas and engine.placement.replicas"):
        EngineConfig.model_validate({"replicas": 3, "placement": {"replicas": 2}})


@pytest.mark.parametrize(
    "section, device, tp_backend",
    [
        ({}, "cpu", "threads"),
        ({"tp": 2}, "cpu", "threads"),
        ({"num_gpus": 1}, "cuda", "threads"),
        ({"num_gpus": 2, "tp": 2}, "cuda", "nccl"),
    ],
)
def test_device_and_tp_backend_follow_the_placement(section, device, tp_backend) -> None:
    engine = JobConfig.model_validate({"engine": section}).engine
    assert (engine.device, engine.tp_backend) == (device, tp_backend)


def test_a_job_refuses_a_device_its_placement_does_not_give() -> None:
    with pytest.raises(ValidationError, match="engine.device 'cuda'"):
        JobConfig.model_validate({"engine": {"device": "cuda"}})
    with pytest.raises(ValidationError, match="engine.tp_backend 'nccl'"):
        JobConfig.model_validate({"engine": {"tp": 2, "tp_backend": "nccl"}})
    # outside a job (tests, benchmarks, `rlsys align`) the engine runs where it is told
    assert EngineConfig(device="cuda", tp=2, tp_backend="nccl").device == "cuda"


def test_the_engine_seed_is_the_jobs_unless_given_and_survives_a_round_trip() -> None:
    job = JobConfig.model_validate({"seed": 5})
    assert job.engine.seed == 5
    assert JobConfig.model_validate(job.model_dump(mode="json")) == job
    assert JobConfig.model_validate({"seed": 5, "engine": {"seed": 9}}).engine.seed == 9


def test_a_replica_runs_the_section_itself_with_the_tokenizers_vocabulary() -> None:
    from rlsys.engine.backends import engine_config
    from rlsys.tokenizer import VOCAB_SIZE

    job = JobConfig.model_validate({"seed": 3, "engine": {"max_running": 4, "tp": 2}})
    replica = engine_config(job)
    assert replica == job.engine.model_copy(update={"sample_vocab": VOCAB_SIZE})


def test_copies_are_validated() -> None:
    engine = EngineConfig(record_selections=True)
    with pytest.raises(ValidationError, match="record_selections needs tp 1 on the CPU"):
        engine.copy_with(device="cuda")


def test_a_job_records_gates_only_when_its_replay_reads_them() -> None:
    def gates(**sections: dict) -> str:
        return JobConfig.model_validate(
            {"model": {"preset": "tiny"}, **sections}
        ).engine.route_gates

    assert gates() == "none"  # the default replay (indices) recomputes the gates
    assert gates(trainer={"replay_experts": "off"}) == "none"
    assert gates(trainer={"replay_experts": "indices_and_gates"}) == "float32"
    # what a user sets is kept, and a replay that needs exact gates still refuses bf16
    assert gates(engine={"route_gates": "bfloat16"}) == "bfloat16"
    with pytest.raises(ValidationError, match="engine.route_gates must be float32"):
        gates(trainer={"replay_experts": "indices_and_gates"}, engine={"route_gates": "none"})
    # the resolved config round-trips (a resume re-reads it from the ledger)
    job = JobConfig.model_validate({"model": {"preset": "tiny"}})
    assert JobConfig.model_validate_json(job.model_dump_json()) == job
