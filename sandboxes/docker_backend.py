"""The `docker` backend: one throw-away container per command, through docker-py.

Each command runs in a new container from a local image: no network (`network_mode=none`),
cgroup memory (no swap), CPU and pids limits, RLIMIT_CPU and RLIMIT_FSIZE, all capabilities
dropped, read-only root filesystem, a private tmpfs /tmp, and the host workspace folder
bind-mounted read-write at /workspace. Output is read from an attach stream with the same
per-stream caps as the other backends (the log driver is off, so the engine keeps nothing).

Invariants:
- docker (docker-py) is imported only here; the registry imports this module lazily.
- Every container carries labels naming its owner (host, pid, pid start time); `run`
  removes its container before returning, `close` removes any left over, and
  `reap_containers` removes those whose owner died.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Mapping
from types import TracebackType
from typing import Any

import docker
from docker.errors import DockerException, ImageNotFound, NotFound
from docker.types import LogConfig, Ulimit
from docker.utils.socket import frames_iter
from requests.exceptions import ConnectionError as RequestsConnectionError
from requests.exceptions import ReadTimeout

from rlsys.sandboxes.base import WORKSPACE_MOUNT, Command, KillReason, RunResult, SandboxError
from rlsys.sandboxes.capped import CappedStream
from rlsys.sandboxes.config import DockerSandboxConfig, SandboxLimits
from rlsys.sandboxes.local import BASE_ENV
from rlsys.sandboxes.runner import infer_limit_reason
from rlsys.sandboxes.workspace import Workspace, is_alive, process_start_time

LABEL = "rlsys.sandbox"


def connect(base_url: str | None = None) -> docker.DockerClient:
    """A client whose engine answered a ping; SandboxError when none answers."""
    try:
        client = docker.DockerClient(base_url=base_url) if base_url else docker.from_env()
        client.ping()
    except (DockerException, RequestsConnectionError) as err:
        raise SandboxError(f"docker backend: no Docker engine answers: {err}") from err
    return client


def owner_labels() -> dict[str, str]:
    pid = os.getpid()
    return {
        LABEL: "1",
        f"{LABEL}.host": socket.gethostname(),
        f"{LABEL}.pid": str(pid),
        f"{LABEL}.start_time": str(process_start_time(pid)),
    }


OOM_FLAG_WAIT_S = 2.0  # how long a SIGKILLed container's OOM flag is waited for


def _sigkill_reason(
    container: Any, state: dict[str, Any], wall_s: float, limits: SandboxLimits
) -> KillReason:
    """Why a container's command died of a SIGKILL that `run` did not send.

    The engine sets `State.OOMKilled` from the kernel's OOM event, which can reach it after
    the exit (under load: seen in CI), so the flag is polled for up to OOM_FLAG_WAIT_S. If
    it never comes, the two senders left are the OOM killer and RLIMIT_CPU's hard limit,
    which cannot fire before `cpu_seconds` of wall time: an earlier SIGKILL is named
    "memory", a later one "cpu" (docker keeps no CPU time once the container is gone)."""
    deadline = time.monotonic() + OOM_FLAG_WAIT_S
    while not state.get("OOMKilled") and time.monotonic() < deadline:
        time.sleep(0.05)
        container.reload()
        state = container.attrs["State"]
    if state.get("OOMKilled"):
        return "memory"
    return "cpu" if wall_s >= limits.cpu_seconds else "memory"


class DockerSandbox:
    backend = "docker"
    isolated = True

    def __init__(self, config: DockerSandboxConfig) -> None:
        self.config = config
        self.limits = config.limits
        self.client = connect(config.base_url)
        try:
            self.client.images.get(config.image)
        except ImageNotFound as err:
            raise SandboxError(f"docker backend: image {config.image!r} not found") from err
        uid = int(config.user.split(":")[0])
        self.workspace = Workspace.create(
            config.workspace_root, self.backend, uid if os.geteuid() == 0 else None
        )
        self._container: Any = None
        self._closed = False

    def run(
        self,
        command: Command,
        *,
        timeout_s: float | None = None,
        stdin: bytes | None = None,
        env: Mapping[str, str] | None = None,
    ) -> RunResult:
        if self._closed:
            raise SandboxError("sandbox is closed")
        argv = ["/bin/sh", "-c", command] if isinstance(command, str) else list(command)
        timeout = timeout_s if timeout_s is not None else self.limits.wall_timeout_s
        full_env = {**BASE_ENV, "HOME": WORKSPACE_MOUNT, "TMPDIR": "/tmp", **(env or {})}
        start = time.monotonic()
        container = self._container = self._create(argv, full_env, stdin is not None)
        try:
            reader = _AttachReader(self.client, container, self.limits, stdin)
            container.start()
            reason = reader.start_and_wait(timeout)
            container.reload()
            state = container.attrs["State"]
            code = int(state["ExitCode"])
            if reason is None and code == 128 + signal.SIGKILL:
                reason = _sigkill_reason(container, state, time.monotonic() - start, self.limits)
        finally:
            container.remove(force=True)
            self._container = None
        stderr = bytes(reader.err.data)
        return RunResult(
            exit_code=code,
            stdout=bytes(reader.out.data),
            stderr=stderr,
            stdout_truncated=reader.out.truncated,
            stderr_truncated=reader.err.truncated,
            wall_s=time.monotonic() - start,
            cpu_s=None,  # the engine's stats end with the container
            max_rss_bytes=None,
            killed_reason=reason or infer_limit_reason(code, stderr, None, self.limits),
            backend=self.backend,
            isolated=True,
        )

    def _create(self, argv: list[str], env: dict[str, str], with_stdin: bool) -> Any:
        limits, cpu = self.limits, self.limits.cpu_seconds
        return self.client.containers.create(
            self.config.image,
            command=argv,
            user=self.config.user,
            working_dir=WORKSPACE_MOUNT,
            environment=env,
            network_mode="none",
            mem_limit=limits.memory_bytes,
            memswap_limit=limits.memory_bytes,  # equal: no swap on top
            nano_cpus=int(self.config.cpus * 1e9),
            pids_limit=limits.max_processes,
            ulimits=[
                Ulimit(name="cpu", soft=cpu, hard=cpu + 1),
                Ulimit(name="fsize", soft=limits.max_file_bytes, hard=limits.max_file_bytes),
                Ulimit(name="core", soft=0, hard=0),
            ],
            read_only=True,
            tmpfs={"/tmp": f"size={limits.tmp_bytes},mode=1777"},
            volumes={str(self.workspace.path): {"bind": WORKSPACE_MOUNT, "mode": "rw"}},
            init=True,  # docker-init as pid 1: reaps, and the command gets default signals
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
            labels={**owner_labels(), f"{LABEL}.id": self.workspace.sandbox_id},
            log_config=LogConfig(type="none"),
            stdin_open=with_stdin,
        )

    def write_file(self, path: str, data: bytes | str) -> None:
        self.workspace.write_file(path, data)

    def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
        return self.workspace.read_file(path, max_bytes)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._container is not None:
            try:
                self._container.remove(force=True)
            except NotFound:
                pass
        self.workspace.remove()

    def __enter__(self) -> DockerSandbox:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class _AttachReader:
    """Reads the container's multiplexed output on a thread, keeping at most the caps."""

    def __init__(self, client: Any, container: Any, limits: Any, stdin: bytes | None) -> None:
        self.container, self.limits = container, limits
        self.out, self.err = (
            CappedStream(limits.max_output_bytes),
            CappedStream(limits.max_output_bytes),
        )
        self.reason: KillReason | None = None
        params = {"stdout": 1, "stderr": 1, "stream": 1, "stdin": int(stdin is not None)}
        self.sock = client.api.attach_socket(container.id, params=params)
        self.stdin = stdin
        self.thread = threading.Thread(target=self._pump, daemon=True)

    def start_and_wait(self, timeout_s: float) -> KillReason | None:
        raw = getattr(self.sock, "_sock", self.sock)
        if self.stdin is not None:
            raw.sendall(self.stdin)
            raw.shutdown(socket.SHUT_WR)
        self.thread.start()
        try:
            self.container.wait(timeout=timeout_s)
        except (ReadTimeout, RequestsConnectionError):
            self.reason = self.reason or "timeout"
            self._kill()
            self.container.wait(timeout=30)
        self.thread.join(timeout=5)
        self.sock.close()
        return self.reason

    def _pump(self) -> None:
        streams = {1: self.out, 2: self.err}
        try:
            for stream_id, chunk in frames_iter(self.sock, tty=False):
                over = streams.get(stream_id, self.err).feed(chunk)
                if over and self.limits.on_output_overflow == "kill" and self.reason is None:
                    self.reason = "output_cap"
                    # Kill from another thread: the engine's kill waits for the output
                    # copy to finish, which needs this thread to keep draining.
                    threading.Thread(target=self._kill, daemon=True).start()
        except OSError:
            pass  # the socket was closed under us after a kill

    def _kill(self) -> None:
        try:
            self.container.kill()
        except (NotFound, DockerException):
            pass  # already gone


def reap_containers(base_url: str | None = None) -> list[str]:
    """Remove rlsys sandbox containers on this host whose owner process is dead."""
    client = connect(base_url)
    removed = []
    for container in client.containers.list(all=True, filters={"label": LABEL}):
        labels = container.labels
        if labels.get(f"{LABEL}.host") != socket.gethostname():
            continue
        start = labels.get(f"{LABEL}.start_time")
        pid = int(labels.get(f"{LABEL}.pid", "0"))
        if not is_alive(pid, int(start) if start and start != "None" else None):
            container.remove(force=True)
            removed.append(container.id)
    return removed
