"""The `Sandbox` protocol and the result of one command.

Invariants:
- `run` never raises for anything the command does (non-zero exit, signals, limits, output
  floods); it returns a `RunResult` whose `killed_reason` names the limit that ended it.
  It raises only for the caller's mistakes or a broken backend (`SandboxError`).
- When `run` returns, no process it started is alive (each backend kills the whole tree).
- `close` is idempotent and removes everything the sandbox created (processes, workspace,
  containers); the context-manager forms always call it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from types import TracebackType
from typing import Any, Literal, Protocol, runtime_checkable

# Why a command was ended from outside. None: it exited on its own.
KillReason = Literal["timeout", "cpu", "memory", "output_cap", "file_size", "processes"]

# Where the workspace appears inside isolating backends (the process backend uses the host path).
WORKSPACE_MOUNT = "/workspace"


class SandboxError(RuntimeError):
    """The backend itself failed (binary missing, engine down, sandbox closed)."""


@dataclass(frozen=True)
class RunResult:
    """What one command did. Byte streams are kept raw; `*_text` decode them leniently."""

    exit_code: int  # 128 + signal number when killed by a signal (shell convention)
    stdout: bytes
    stderr: bytes
    stdout_truncated: bool
    stderr_truncated: bool
    wall_s: float
    cpu_s: float | None  # user + system of the whole tree, when the backend can measure it
    max_rss_bytes: int | None  # largest resident set of any process in the tree
    killed_reason: KillReason | None
    backend: str
    isolated: bool  # False only for the development `process` backend

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.killed_reason is None

    @property
    def stdout_text(self) -> str:
        return self.stdout.decode("utf-8", errors="replace")

    @property
    def stderr_text(self) -> str:
        return self.stderr.decode("utf-8", errors="replace")

    def summary(self) -> dict[str, Any]:
        """JSON-ready view: streams decoded (invalid UTF-8 replaced), everything else as is."""
        out = asdict(self)
        out["stdout"] = self.stdout_text
        out["stderr"] = self.stderr_text
        return out


Command = str | Sequence[str]  # a str runs under /bin/sh -c; a sequence is an argv


@runtime_checkable
class Sandbox(Protocol):
    """A per-rollout place to run untrusted commands, with a private workspace."""

    backend: str
    isolated: bool

    def run(
        self,
        command: Command,
        *,
        timeout_s: float | None = None,
        stdin: bytes | None = None,
        env: Mapping[str, str] | None = None,
    ) -> RunResult:
        """Run one command in the workspace; `timeout_s` overrides the configured wall limit."""
        ...

    def write_file(self, path: str, data: bytes | str) -> None:
        """Write a file at `path`, relative to the workspace (parents are created)."""
        ...

    def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
        """Read a file at `path`, relative to the workspace; symlinks are never followed."""
        ...

    def close(self) -> None:
        """Kill anything still running and remove the workspace (idempotent)."""
        ...

    def __enter__(self) -> Sandbox: ...

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...
