"""A sandbox made of a host workspace folder plus a `Launcher` that wraps each command.

The `bwrap` and `process` backends differ only in how a command is launched (argv, uid,
environment, where the workspace appears); everything else — workspace files, capped
capture, timeouts, teardown — is this one class.

Invariants:
- Every `run` starts a fresh process tree and kills all of it before returning, so no
  process outlives the command, let alone the rollout.
- `close` removes the workspace folder; after `close`, `run` and file access raise.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Protocol

from rlsys.sandboxes.base import Command, RunResult, SandboxError
from rlsys.sandboxes.config import SandboxLimits
from rlsys.sandboxes.runner import run_captured
from rlsys.sandboxes.workspace import Workspace

BASE_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONUNBUFFERED": "1",
}


class Launcher(Protocol):
    """How a backend turns a command into a host argv."""

    backend: str
    isolated: bool
    run_as_uid: int | None  # host uid to launch under (None: the caller's own)
    leader_usage_counts: bool  # wait4 on the launched process measures the command tree

    def workspace_dir(self, workspace: Path) -> str:
        """The workspace as the command sees it (its cwd and $HOME)."""
        ...

    def argv(self, workspace: Path, command: list[str], usage_fd: int, info_fd: int) -> list[str]:
        """The host argv; `usage_fd`/`info_fd`: see `rlsys.sandboxes.runner.run_captured`."""
        ...


class LocalSandbox:
    """A `Sandbox` whose commands run on this host through a `Launcher`."""

    def __init__(self, launcher: Launcher, limits: SandboxLimits, workspace_root: Path) -> None:
        self.launcher = launcher
        self.limits = limits
        self.backend = launcher.backend
        self.isolated = launcher.isolated
        self.workspace = Workspace.create(workspace_root, self.backend, launcher.run_as_uid)
        self._closed = False

    @property
    def sandbox_id(self) -> str:
        return self.workspace.sandbox_id

    def run(
        self,
        command: Command,
        *,
        timeout_s: float | None = None,
        stdin: bytes | None = None,
        env: Mapping[str, str] | None = None,
    ) -> RunResult:
        self._check_open()
        argv = ["/bin/sh", "-c", command] if isinstance(command, str) else list(command)
        if not argv:
            raise SandboxError("empty command")
        inner_dir = self.launcher.workspace_dir(self.workspace.path)
        full_env = {**BASE_ENV, "HOME": inner_dir, "TMPDIR": "/tmp", **(env or {})}
        try:
            captured = run_captured(
                lambda usage_fd, info_fd: self.launcher.argv(
                    self.workspace.path, argv, usage_fd, info_fd
                ),
                limits=self.limits,
                timeout_s=timeout_s if timeout_s is not None else self.limits.wall_timeout_s,
                cwd=str(self.workspace.path),
                env=full_env,
                stdin=stdin,
                track=self.workspace.track,
                user=self.launcher.run_as_uid,
                leader_usage_counts=self.launcher.leader_usage_counts,
            )
        except (FileNotFoundError, PermissionError) as err:
            raise SandboxError(f"{self.backend}: cannot start {argv[0]!r}: {err}") from err
        return RunResult(**vars(captured), backend=self.backend, isolated=self.isolated)

    def write_file(self, path: str, data: bytes | str) -> None:
        self._check_open()
        self.workspace.write_file(path, data)

    def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
        self._check_open()
        return self.workspace.read_file(path, max_bytes)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.workspace.remove()

    def __enter__(self) -> LocalSandbox:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError(f"sandbox {self.sandbox_id} is closed")


def running_as_root() -> bool:
    return os.geteuid() == 0
