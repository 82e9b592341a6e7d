"""`rlsys monitor` reads per-step training signals from any ledger, as JSON, plot or events."""

import json
import subprocess
import sys

import pytest

from rlsys.ledger.store import Ledger

pytestmark = pytest.mark.unit

KEYS = {
    "step",
    "policy_version",
    "staleness",
    "logprob_drift",
    "reward_mean",
    "entropy",
    "num_samples",
}


def _ledger_with_steps(path, n=3):
    url = f"sqlite:///{path}"
    lg = Ledger.open(url)
    job = lg.create_job("mon", {})
    for step in range(1, n + 1):
        # Step 1 has no `serving` block, as a job recorded before it existed.
        serving = (
            {"serving": {"queue_depth": step, "prefix_cache_hit_rate": 0.5}} if step > 1 else {}
        )
        lg.record_trainer_step(
            job,
            step,
            step,
            {
                **serving,
                "staleness": {"mean": 0.5, "max": 1},
                "logprob_drift": {"mean_abs": 0.0, "max_abs": 0.0},
                "reward_mean": 0.1 * step,
                "entropy": 2.0,
                "num_samples": 16,
                "kl": 0.0,
                "drop_rate": 0.0,
            },
        )
    lg.close()
    return url, job


def test_monitor_json_plot_and_tensorboard(tmp_path):
    url, job = _ledger_with_steps(tmp_path / "l.db")
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlsys.cli",
            "monitor",
            "--db",
            url,
            "--job",
            job,
            "--json",
            "--plot",
            str(tmp_path / "c.png"),
            "--tensorboard",
            str(tmp_path / "tb"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(KEYS <= set(r) for r in rows)
    assert (tmp_path / "c.png").stat().st_size > 10_000
    assert any((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_monitor_unknown_job_is_exit_2(tmp_path):
    url, _ = _ledger_with_steps(tmp_path / "l.db", 1)
    res = subprocess.run(
        [sys.executable, "-m", "rlsys.cli", "monitor", "--db", url, "--job", "j-x"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2 and "unknown job" in res.stderr


def test_monitor_table_shows_the_serving_side(tmp_path):
    url, job = _ledger_with_steps(tmp_path / "l.db")
    res = subprocess.run(
        [sys.executable, "-m", "rlsys.cli", "monitor", "--db", url, "--job", job],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert "queue depth" not in lines[0]  # nothing recorded, nothing shown
    assert "admission queue depth=3" in lines[2] and "prefix-cache hit rate=0.5" in lines[2]
