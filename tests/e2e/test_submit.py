"""`rlsys submit` against a real `ray start --head` on this machine, token auth included."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.ray]

ROOT = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).parent / "ray")


def _answers(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def _answers(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def ray_head(tmp_path):
    import ray

    if ray.is_initialized():  # the in-process cluster of earlier e2e tests
        ray.shutdown()
    gcs, dash = _free_port(), _free_port()
    # `--block` keeps the head's processes children of this one `ray start`: terminating it
    # stops exactly this cluster (`ray stop` would stop every Ray cluster on the machine).
    head = subprocess.Popen(
        [
            RAY,
            "start",
            "--head",
            f"--port={gcs}",
            f"--dashboard-port={dash}",
            "--dashboard-host=127.0.0.1",
            "--num-cpus=4",
            "--disable-usage-stats",
            "--block",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not _answers(dash):
            assert head.poll() is None and time.monotonic() < deadline, "ray head did not start"
            time.sleep(0.5)
        yield f"http://127.0.0.1:{dash}"
    finally:
        head.terminate()
        head.wait(timeout=120)


def test_submit_runs_the_job_on_the_cluster_and_accounts_for_it(ray_head, tmp_path):
    ledger = f"sqlite:///{tmp_path / 'ledger.db'}"
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlsys.cli",
            "submit",
            "configs/smoke-tiny.yaml",
            "--address",
            ray_head,
            "--set",
            f"store.ledger_url={ledger}",
            "--python",
            sys.executable,
            "--wait",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    job_id = res.stdout.strip().splitlines()[-1]
    assert job_id.startswith("j-") and "completed" in res.stdout
    stats = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlsys.cli",
            "ledger",
            "stats",
            "--db",
            ledger,
            "--job",
            job_id,
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    out = json.loads(stats.stdout)
    assert out["job_status"] == "completed" and out["lost"] == 0 and out["consumed"] > 0
    status = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlsys.cli",
            "jobs",
            "status",
            job_id,
            "--db",
            ledger,
            "--address",
            ray_head,
            "--json",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert json.loads(status.stdout)["ray_status"] == "SUCCEEDED"


def test_submit_to_an_unreachable_cluster_is_a_one_line_error():
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlsys.cli",
            "submit",
            "configs/smoke-tiny.yaml",
            "--address",
            f"http://127.0.0.1:{_free_port()}",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert res.returncode == 2 and "cannot reach the Ray Jobs API" in res.stderr
