"""Services a chaos test owns: a Redis server it starts (append-only, fsync on every
write) and kills, and the machine's PostgreSQL, restarted through pg_ctlcluster.

Only what a test started is stopped, by its process id.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

from tests.conftest import PG_HOST, PG_PORT, missing_service, service_answers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """A private redis-server on a free port; its data (the AOF) lives in `data_dir`.

    `appendfsync always`: an entry Redis acknowledged is on disk, so a SIGKILL loses no
    published trajectory (with the default `everysec` it could lose the last second)."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir, self.port = data_dir, free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "yes", "--appendfsync", "always", "--dir", str(self.data_dir)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while not service_answers("127.0.0.1", self.port):
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(timeout=30)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            self.kill()


def stand_in_until_knocked(port: int, min_s: float, bound_s: float) -> int:
    """While a server on `port` is down: listen there in its place and close every
    connection a client opens (what a client meets when the server dies under it), until
    at least `min_s` have passed and some client has knocked, or `bound_s` have. Returns
    the number of connections closed: > 0 means a client really met the outage, however
    slowly the job reached the stream on a loaded box."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(64)
    listener.settimeout(0.1)
    started, knocks = time.monotonic(), 0
    try:
        while True:
            elapsed = time.monotonic() - started
            if elapsed >= bound_s or (elapsed >= min_s and knocks):
                return knocks
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            conn.close()
            knocks += 1
    finally:
        listener.close()


def require_redis_server() -> None:
    if shutil.which("redis-server") is None:
        missing_service("redis-server is not installed")


def restart_postgres() -> None:
    """Restart the machine's PostgreSQL (fast shutdown: every connection is cut)."""
    version = sorted(p.name for p in Path("/etc/postgresql").iterdir())[-1]
    subprocess.run(
        ["pg_ctlcluster", "--skip-systemctl-redirect", version, "main", "restart", "-m", "fast"],
        check=True,
        timeout=120,
        capture_output=True,
    )
    deadline = time.monotonic() + 60
    while not service_answers(PG_HOST, PG_PORT):
        assert time.monotonic() < deadline, "PostgreSQL did not come back"
        time.sleep(0.1)


def require_restartable_postgres() -> None:
    if not (shutil.which("pg_ctlcluster") and Path("/etc/postgresql").is_dir()):
        missing_service("this machine's PostgreSQL is not managed by pg_ctlcluster")
