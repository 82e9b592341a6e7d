"""A job on a local Ray cluster reports to W&B (offline), MLflow (a local file store) and
TensorBoard, read back from what each wrote: every step's series exactly as `rlsys monitor`
shows them, the resolved config, and the ledger's final stats. The job finds its ledger by
`RLSYS_LEDGER_URL`, as `rlsys monitor` does."""

import json
import os
import subprocess
import sys

import pytest

from rlsys.actors.job import run_job
from tests.tracking.readers import tensorboard_scalars, wandb_run

pytestmark = [pytest.mark.e2e, pytest.mark.ray]

# What `rlsys monitor --json` prints for a step -> the series name trackers record it as.
SERIES = {
    ("reward_mean",): "reward_mean",
    ("staleness", "mean"): "staleness/mean",
    ("staleness", "max"): "staleness/max",
    ("logprob_drift", "mean_abs"): "logprob_drift/mean_abs",
    ("logprob_drift", "max_abs"): "logprob_drift/max_abs",
    ("drop_rate",): "drop_rate",
    ("samples_per_s",): "samples_per_s",
    ("num_samples",): "num_samples",
    ("entropy",): "entropy",
    ("kl",): "kl",
    ("serving", "queue_depth"): "serving/queue_depth",
    ("policy_version",): "policy_version",
}
MISMATCH = ("mean_abs", "max_abs", "k3_kl")  # recorded wherever a step measured it


def _expected(row: dict) -> dict[str, float]:
    out = {}
    for path, name in SERIES.items():
        value = row
        for key in path:
            value = value[key]
        out[name] = float(value)
    for key in MISMATCH:
        if key in row.get("mismatch", {}):
            out[f"mismatch/{key}"] = float(row["mismatch"][key])
    return out


def test_a_job_reports_its_series_config_and_final_stats_to_every_tracker(
    tiny_job, tmp_path, monkeypatch
):
    ledger = f"sqlite:///{tmp_path / 'elsewhere' / 'ledger.db'}"
    monkeypatch.setenv("RLSYS_LEDGER_URL", ledger)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 gates its file store
    wandb_dir, mlruns, tb_dir = tmp_path / "wandb", tmp_path / "mlruns", tmp_path / "tb"
    trackers = (
        f"[{{type: wandb, mode: offline, project: rlsys-test, dir: '{wandb_dir}'}}, "
        f"{{type: mlflow, tracking_uri: 'file://{mlruns}', experiment: e2e}}, "
        f"{{type: tensorboard, dir: '{tb_dir}'}}]"
    )
    cfg = tiny_job(2, f"tracking={trackers}")
    summary = run_job(cfg, on_event=lambda s: None)
    job_id = summary["job_id"]
    assert summary["status"] == "completed"
    assert not (
        tmp_path / "runs" / "ledger.db"
    ).exists()  # the environment's ledger, not RUN_ROOT's

    monitor = subprocess.run(
        [sys.executable, "-m", "rlsys.cli", "monitor", "--job", job_id, "--json"],
        capture_output=True,
        text=True,
        env={**os.environ, "RLSYS_LEDGER_URL": ledger},
        timeout=120,
    )
    assert monitor.returncode == 0, monitor.stderr
    expected = {row["step"]: _expected(row) for row in map(json.loads, monitor.stdout.splitlines())}
    assert sorted(expected) == [1, 2]
    final = {k: summary[k] for k in ("expected", "consumed", "discarded", "dropped", "lost")}

    # Weights & Biases, offline: the run file
    (run_file,) = wandb_dir.glob(f"wandb/offline-run-*-{job_id}/run-{job_id}.wandb")
    wb = wandb_run(run_file)
    assert {s: {k: wb["history"][s][k] for k in e} for s, e in expected.items()} == expected
    assert wb["config"]["trainer"]["steps"] == 2 and wb["config"]["name"] == cfg.name
    assert {k: wb["summary"][f"ledger/{k}"] for k in final} == final
    assert wb["summary"]["ledger/job_status"] == "completed" and wb["exit_code"] == 0

    # MLflow, a local file store
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"file://{mlruns}")
    (run,) = client.search_runs([client.get_experiment_by_name("e2e").experiment_id])
    assert run.info.run_name == job_id and run.info.status == "FINISHED"
    recorded = {
        step: {name: _history(client, run.info.run_id, name)[step] for name in e}
        for step, e in expected.items()
    }
    assert recorded == expected
    assert run.data.params["trainer.steps"] == "2"
    artifacts = client.download_artifacts(run.info.run_id, "", str(tmp_path / "artifacts"))
    with open(os.path.join(artifacts, "config.json")) as f:
        assert json.load(f)["trainer"]["steps"] == 2
    assert {k: run.data.metrics[f"ledger/{k}"] for k in final} == final

    # TensorBoard
    scalars = tensorboard_scalars(tb_dir)
    for step, e in expected.items():
        assert {k: scalars[k][step] for k in e} == pytest.approx(e, rel=1e-6)
    assert scalars["ledger/expected"][2] == final["expected"]


def _history(client, run_id: str, name: str) -> dict[int, float]:
    return {m.step: m.value for m in client.get_metric_history(run_id, name)}
