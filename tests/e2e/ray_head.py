"""A real `ray start --head` for the cluster tests: its own ports, token auth on, metrics.

`--block` keeps the head's processes children of this one `ray start`: terminating it stops
exactly this cluster (`ray stop` would stop every Ray cluster on the machine). The token
is this head's own, passed in the environment (RAY_AUTH_MODE=token, RAY_AUTH_TOKEN), so
nothing is written to ~/.ray; a client must present it, as on any Ray 2.60 cluster.
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

RAY = str(Path(sys.executable).parent / "ray")
# Variables of the test's own shell that would point a client elsewhere than this head.
CALLER_VARS = (
    "RAY_ADDRESS",
    "RAY_API_SERVER_ADDRESS",
    "RAY_AUTH_MODE",
    "RAY_AUTH_TOKEN",
    "RAY_AUTH_TOKEN_PATH",
    "RLSYS_LEDGER_URL",
)


@dataclass(frozen=True)
class RayHead:
    address: str  # the Jobs API (dashboard) URL
    metrics_url: str  # this node's Prometheus endpoint
    token: str

    def user_env(self, **extra: str) -> dict[str, str]:
        """A user's shell that holds the cluster's token (and nothing else of Ray's)."""
        env = {k: v for k, v in os.environ.items() if k not in CALLER_VARS}
        return {**env, "RAY_AUTH_TOKEN": self.token, **extra}


def answers(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def start_head(num_cpus: int = 4) -> Iterator[RayHead]:
    gcs, dash, metrics = free_port(), free_port(), free_port()
    # Every port its own: the defaults (the agent's 52365, the client server's 10001, ...) may
    # be held by another Ray cluster on the machine, and a job agent that cannot bind makes
    # the Jobs API refuse every job.
    own_ports = [
        f"--{flag}={free_port()}"
        for flag in (
            "dashboard-agent-listen-port",
            "dashboard-agent-grpc-port",
            "runtime-env-agent-port",
            "ray-client-server-port",
        )
    ]
    token = secrets.token_hex(32)
    env = {k: v for k, v in os.environ.items() if k not in CALLER_VARS}
    env.update(
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN=token,
        # processes report metrics to their node's agent every second (default 10 s)
        RAY_metrics_report_interval_ms="1000",
    )
    head = subprocess.Popen(
        [
            RAY,
            "start",
            "--head",
            f"--port={gcs}",
            f"--dashboard-port={dash}",
            "--dashboard-host=127.0.0.1",
            f"--metrics-export-port={metrics}",
            *own_ports,
            f"--num-cpus={num_cpus}",
            "--disable-usage-stats",
            "--block",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 120
        while not answers(dash):
            assert head.poll() is None and time.monotonic() < deadline, "ray head did not start"
            time.sleep(0.5)
        yield RayHead(f"http://127.0.0.1:{dash}", f"http://127.0.0.1:{metrics}/metrics", token)
    finally:
        head.terminate()
        head.wait(timeout=120)
