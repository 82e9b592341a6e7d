"""Invalid configs: every error names the field path, exits 2, and starts nothing."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlsys.cli.errors import UserError
from rlsys.cli.job_config import load_job_config

pytestmark = pytest.mark.unit

QUICKSTART = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"


def test_quickstart_config_is_valid():
    cfg = load_job_config(str(QUICKSTART))
    assert cfg.model.resolve().n_layers >= 1 and cfg.rollout.task["type"] == "arithmetic"


def test_vllm_tiny_config_is_valid_and_resolves_its_model_directory():
    cfg = load_job_config(str(QUICKSTART.parent / "vllm-tiny.yaml"))
    assert cfg.engine.backend == "vllm" and cfg.model.kind == "hf"
    assert cfg.model.path is not None and Path(cfg.model.path).is_absolute()
    assert load_job_config(str(QUICKSTART)).engine.backend == "native"  # the default


def test_gpu_example_config_is_valid_and_places_models_on_cuda(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "http://head:8265")  # submitted to a GPU cluster
    cfg = load_job_config(str(QUICKSTART.parent / "gpu-example.yaml"))
    assert cfg.engine.placement.num_gpus == 1 and cfg.trainer.num_gpus == 1
    assert cfg.engine.weight_transport == "collective"
    assert cfg.engine.device == "cuda"  # the section is the engine's configuration
    assert load_job_config(str(QUICKSTART)).engine.device == "cpu"


@pytest.mark.parametrize("name, tp, gpus", [("gpu-2x.yaml", 1, 2), ("gpu-tp2.yaml", 2, 3)])
def test_gpu_job_configs_are_valid(name, tp, gpus, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "http://head:8265")  # validated as on a GPU node
    cfg = load_job_config(str(QUICKSTART.parent / name))
    engine, placement = cfg.engine, cfg.engine.placement
    assert engine.tp == tp and engine.device == "cuda"
    assert engine.tp_backend == ("nccl" if tp > 1 else "threads")
    assert placement.replicas * placement.num_gpus + cfg.trainer.num_gpus == gpus
    assert cfg.rollout.task["type"] == "code"


def test_one_gpu_config_is_the_quickstart_on_a_shared_gpu(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "http://head:8265")  # validated as on a GPU node
    cfg = load_job_config(str(QUICKSTART.parent / "gpu-1x.yaml"))
    quick = load_job_config(str(QUICKSTART))
    placement = cfg.engine.placement
    assert cfg.engine.device == "cuda"
    assert placement.replicas * placement.num_gpus + cfg.trainer.num_gpus == 1
    assert cfg.engine.weight_transport == "object_store"  # no NCCL within one GPU
    assert cfg.rollout == quick.rollout and cfg.algo == quick.algo
    assert cfg.trainer.model_copy(update={"num_gpus": 0.0, "num_cpus": 1.0}) == quick.trainer


@pytest.mark.parametrize(
    "sets, message",
    [
        (
            ("engine.replicas=0",),
            "engine.placement.replicas: Input should be greater than or equal to 1",
        ),
        (("engine.placement.replicas=3",), "engine.replicas and engine.placement.replicas"),
        (("engine.device=cuda",), "engine.device 'cuda': a replica runs on the device Ray"),
        (("sampling.top_p=1.5",), "sampling.top_p: Input should be less than or equal to 1"),
        (("engine.replicaz=2",), "engine.replicaz: unknown key"),
        (("engine.tp=3",), "engine.tp:"),
        (("trainer.lr=fast",), "trainer.lr: Input should be a valid number"),
        (("model.preset=huge",), "unknown preset 'huge'; allowed:"),
        (("rollout.task.type=chess",), "rollout.task"),
        (("rollout.task.max_factor=0",), "rollout.task.max_factor"),
        (("rollout.sandbox.type=vm",), "rollout.sandbox"),
        (("rollout.scaffold.temperature=0.5",), "rollout.scaffold: set ['temperature']"),
        (
            ("trainer.groups_per_step=13",),
            "trainer.groups_per_step must be <= rollout.groups_in_flight",
        ),
        (
            ("algo.max_staleness=0",),
            "rollout.groups_in_flight (12) must be <= trainer.groups_per_step * "
            "(algo.max_staleness + 1) (8)",
        ),
        (("rollout.pipeline=lockstep",), "rollout.pipeline: Input should be 'async' or 'sync'"),
        (("engine.num_gpus=1",), "engine.placement.num_gpus / trainer.num_gpus: > 0 but"),
        (
            ("engine.num_gpus=1", "engine.tp=2"),
            "engine.tp (2) with engine.placement.num_gpus (1.0): a GPU replica runs one NCCL "
            "rank per GPU",
        ),
        (
            ("engine.num_gpus=1", "engine.weight_transport=collective"),
            "engine.weight_transport: collective needs the trainer and the replicas on the "
            "same kind of device",
        ),
        (("engine.weight_transport=pigeon",), "engine.weight_transport: Input should be"),
        (("trainer.warm_start.slip_rate=1",), "trainer.warm_start.slip_rate: Input should be less"),
        (("engine.backend=vllm",), "engine.backend 'vllm' serves model.kind 'hf', not 'native'"),
        (("model.kind=hf",), "model.path: kind hf needs a local Hugging Face model directory"),
        (("model.make_tiny=qwen3",), "model.make_tiny: only for model.kind hf"),
        (("engine.backend=sglang",), "engine.backend: Input should be 'native' or 'vllm'"),
        (
            ("model.kind=hf", "model.path=/m", "engine.backend=vllm", "engine.tp=2"),
            "engine.backend vllm: weights move through the object store",
        ),
    ],
)
def test_invalid_values_name_their_field(sets, message, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    if "num_gpus" in sets[0]:
        monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(UserError) as err:
        load_job_config(str(QUICKSTART), sets)
    assert message in str(err.value)


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(UserError, match="config file not found"):
        load_job_config(str(tmp_path / "nope.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("engine: [unclosed\n")
    with pytest.raises(UserError, match="not valid YAML"):
        load_job_config(str(bad))


def test_run_with_a_bad_config_exits_2_and_starts_nothing(tmp_path):
    env = {**os.environ, "RLSYS_RUN_ROOT": str(tmp_path)}
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlsys.cli",
            "run",
            str(QUICKSTART),
            "--set",
            "engine.replicas=-1",
            "--set",
            f"store.run_root={tmp_path}",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert res.returncode == 2
    assert "engine.placement.replicas" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []  # no ledger, no run directory
    assert "ray" not in res.stderr.lower()


def test_run_of_a_missing_hf_model_directory_says_what_to_run(tmp_path):
    missing = tmp_path / "no-model"
    sets = [f"model.path={missing}", "model.make_tiny=null", f"store.run_root={tmp_path}"]
    res = subprocess.run(
        [sys.executable, "-m", "rlsys.cli", "run", str(QUICKSTART.parent / "vllm-tiny.yaml"),
         *[arg for s in sets for arg in ("--set", s)]],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert res.returncode == 2, res.stderr
    assert f"model.path: {missing} does not exist" in res.stderr
    assert f"python -m rlsys.model.hf_tiny {missing}" in res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing started, nothing written
