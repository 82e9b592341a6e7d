"""The cluster user's workflow against a real `ray start --head` on this machine, token auth
on: submit from the shell, watch the job there (Ray's status, the ledger, the monitor, the
driver's output, the node's Prometheus endpoint), stop it, find everything accounted for.
What the README's "Run on a Ray cluster" section tells a user to do, command by command.
"""

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from tests.e2e.ray_head import RayHead, free_port, start_head

pytestmark = [pytest.mark.e2e, pytest.mark.ray]

ROOT = Path(__file__).resolve().parents[2]
DESIGN_STEP_KEYS = {"step", "policy_version", "staleness", "logprob_drift", "reward_mean"}


@pytest.fixture(scope="module")
def head():
    # a cluster of its own, beside the session's in-process one (left running for the tests
    # after these: it does not take part)
    with start_head() as h:
        yield h


def rlsys(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rlsys.cli", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=timeout,
    )


def follow(*args: str, env: dict[str, str]) -> tuple[subprocess.Popen, list[str]]:
    """Start a following command; its stdout lines collect in the returned list."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlsys.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=env,
    )
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    return proc, lines


def wait_for(what: str, check, timeout: float = 480, every: float = 1.0, seen=lambda: ""):
    deadline = time.monotonic() + timeout
    while not (result := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {seen()}"
        time.sleep(every)
    return result


def job_status(job_id: str, env: dict[str, str]) -> dict:
    res = rlsys("jobs", "status", job_id, "--json", env=env)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def scrape(head: RayHead, job_id: str) -> dict[str, float]:
    """The node's Prometheus samples of rlsys metrics labelled with this job."""
    body = urllib.request.urlopen(head.metrics_url, timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in body.splitlines():
        if line.startswith("ray_rlsys_") and f'job_id="{job_id}"' in line:
            name = line.split("{", 1)[0]
            if name == "ray_rlsys_rollouts_ended_total":
                name += "/" + line.split('state="', 1)[1].split('"', 1)[0]
            out[name] = float(line.rsplit(" ", 1)[1])
    return out


def test_a_submitted_job_is_watched_and_stopped_from_the_users_shell(head, pg_database_url):
    # The user's shell: the cluster's token, its address and a ledger both sides reach.
    env = head.user_env(RAY_API_SERVER_ADDRESS=head.address, RLSYS_LEDGER_URL=pg_database_url)
    sub = rlsys(
        "submit",
        "configs/smoke-tiny.yaml",
        "--set",
        "trainer.steps=500",  # it runs until stopped
        "--python",
        sys.executable,
        env=env,
    )
    assert sub.returncode == 0, sub.stderr
    job_id = sub.stdout.strip().splitlines()[-1]
    assert job_id.startswith("j-")

    last: list[str] = []
    running = wait_for("the job to run", lambda: _running(job_id, env, last), seen=lambda: last)
    assert running["ray_status"] == "RUNNING"
    monitor, steps = follow(
        "monitor", "--job", job_id, "--follow", "--json", "--interval", "0.5", env=env
    )
    logs, output = follow("jobs", "logs", job_id, "--follow", env=env)
    try:
        _watch_and_stop(head, job_id, env, monitor, steps, logs, output)
    finally:
        for proc in (monitor, logs):
            if proc.poll() is None:
                proc.kill()

    final = job_status(job_id, env)
    assert final["ray_status"] == "STOPPED" and final["job_status"] == "stopped"
    assert final["lost"] == 0 and final["in_flight"] == 0 and final["consumed"] > 0


def _watch_and_stop(head, job_id, env, monitor, steps, logs, output):
    wait_for("the monitor's first step", lambda: steps, seen=lambda: "".join(output)[-2000:])

    stats = json.loads(rlsys("ledger", "stats", "--job", job_id, "--json", env=env).stdout)
    assert stats["job_status"] == "running" and stats["expected"] > 0

    exported = wait_for(
        "the job's metrics on the Prometheus endpoint",
        lambda: (m := scrape(head, job_id)).get("ray_rlsys_policy_version", 0) >= 1 and m,
        timeout=120,
        seen=lambda: "".join(output)[-2000:],
    )
    for name in (
        "ray_rlsys_rollouts_in_flight",
        "ray_rlsys_admission_queue_depth",
        "ray_rlsys_staleness_mean",
        "ray_rlsys_staleness_max",
    ):
        assert name in exported, sorted(exported)
    assert exported["ray_rlsys_rollouts_ended_total/trained"] > 0

    stop = rlsys("jobs", "stop", job_id, "--wait", env=env)
    # Both followers end by themselves when the job does.
    assert monitor.wait(timeout=120) == 0, monitor.stderr.read()
    assert logs.wait(timeout=120) == 0, logs.stderr.read()
    assert stop.returncode == 0, stop.stderr
    assert f"{job_id} stopped" in stop.stdout, "".join(output)[-3000:]
    rows = [json.loads(line) for line in steps]
    assert rows and all(DESIGN_STEP_KEYS <= set(r) for r in rows)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    driver = "".join(output)
    assert "step    1" in driver and "stopped" in driver


def _running(job_id: str, env: dict[str, str], last: list[str]) -> dict | None:
    res = rlsys("jobs", "status", job_id, "--json", env=env)
    last[:] = [res.stdout[-500:], res.stderr[-500:]]
    if res.returncode != 0:  # the driver has not created the job's ledger row yet
        return None
    out = json.loads(res.stdout)
    return out if out.get("job_status") == "running" else None


def test_submit_with_wait_prints_the_output_and_accounts_for_the_job(head, tmp_path):
    ledger = f"sqlite:///{tmp_path / 'ledger.db'}"  # absolute: outside the working directory
    env = head.user_env()
    res = rlsys(
        "submit",
        "configs/smoke-tiny.yaml",
        "--address",
        head.address,
        "--set",
        f"store.ledger_url={ledger}",
        "--python",
        sys.executable,
        "--wait",
        env=env,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    job_id = res.stdout.strip().splitlines()[-1]
    assert job_id.startswith("j-") and "completed" in res.stdout
    stats = json.loads(
        rlsys("ledger", "stats", "--db", ledger, "--job", job_id, "--json", env=env).stdout
    )
    assert stats["job_status"] == "completed" and stats["lost"] == 0 and stats["consumed"] > 0
    status = rlsys(
        "jobs", "status", job_id, "--db", ledger, "--address", head.address, "--json", env=env
    )
    assert json.loads(status.stdout)["ray_status"] == "SUCCEEDED"


def test_the_cluster_refuses_a_caller_without_its_token(head, tmp_path):
    # HOME elsewhere: no ~/.ray/auth_token either
    env = {k: v for k, v in head.user_env(HOME=str(tmp_path)).items() if k != "RAY_AUTH_TOKEN"}
    res = rlsys("jobs", "status", "j-nope", "--address", head.address, env=env)
    assert res.returncode == 2 and "requires an auth token" in res.stderr


def test_submit_refuses_a_ledger_inside_the_clusters_working_directory():
    env = {k: v for k, v in os.environ.items() if k != "RLSYS_LEDGER_URL"}
    address = f"http://127.0.0.1:{free_port()}"  # never contacted
    res = rlsys("submit", "configs/smoke-tiny.yaml", "--address", address, env=env)
    assert res.returncode == 2, res.stderr
    assert "temporary working directory" in res.stderr and "RLSYS_LEDGER_URL" in res.stderr


@pytest.mark.parametrize(
    "flag, api_server, ray_address, chosen",
    [
        (True, True, True, "flag"),
        (False, True, True, "api_server"),
        (False, False, True, "ray_address"),
    ],
)
def test_the_cluster_address_is_the_flag_then_ray_api_server_address_then_ray_address(
    flag, api_server, ray_address, chosen
):
    ports = {name: free_port() for name in ("flag", "api_server", "ray_address")}
    url = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RLSYS_LEDGER_URL")
    }
    env["RLSYS_LEDGER_URL"] = "postgresql://nobody@127.0.0.1/never_opened"
    if api_server:
        env["RAY_API_SERVER_ADDRESS"] = url["api_server"]
    if ray_address:
        env["RAY_ADDRESS"] = url["ray_address"]
    args = ["submit", "configs/smoke-tiny.yaml"] + (["--address", url["flag"]] if flag else [])
    res = rlsys(*args, env=env)
    assert res.returncode == 2
    # what Ray's client actually contacted (it would let the environment override the flag)
    assert f"Failed to connect to Ray at address: {url[chosen]}" in res.stderr, res.stderr
    assert [u for name, u in url.items() if name != chosen and u in res.stderr] == []


def test_submit_without_any_cluster_address_says_what_to_set():
    env = {
        k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")
    }
    res = rlsys("submit", "configs/smoke-tiny.yaml", env=env)
    assert res.returncode == 2 and "RAY_API_SERVER_ADDRESS" in res.stderr


def test_submit_to_an_unreachable_cluster_is_a_one_line_error(tmp_path):
    env = {**os.environ, "RLSYS_LEDGER_URL": f"sqlite:///{tmp_path / 'ledger.db'}"}
    address = f"http://127.0.0.1:{free_port()}"
    res = rlsys("submit", "configs/smoke-tiny.yaml", "--address", address, env=env)
    assert res.returncode == 2 and "cannot reach the Ray Jobs API" in res.stderr
