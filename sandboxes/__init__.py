"""Sandbox backends only: bwrap (default), docker, process (the agent loop is `rlsys.rollout`).

Sandbox API: `open_sandbox(config) -> Sandbox`, `RunResult`, the configs in
`rlsys.sandboxes.config`, `AsyncSandbox`, and `reap_orphans` for start-up cleanup.
"""

from rlsys.sandboxes.async_sandbox import AsyncSandbox
from rlsys.sandboxes.base import KillReason, RunResult, Sandbox, SandboxError
from rlsys.sandboxes.config import (
    BwrapSandboxConfig,
    DockerSandboxConfig,
    ProcessSandboxConfig,
    SandboxConfig,
    SandboxLimits,
)
from rlsys.sandboxes.reaper import reap_orphans
from rlsys.sandboxes.registry import BACKENDS, open_sandbox, parse_sandbox_config

__all__ = [
    "BACKENDS",
    "AsyncSandbox",
    "BwrapSandboxConfig",
    "DockerSandboxConfig",
    "KillReason",
    "ProcessSandboxConfig",
    "RunResult",
    "Sandbox",
    "SandboxConfig",
    "SandboxError",
    "SandboxLimits",
    "open_sandbox",
    "parse_sandbox_config",
    "reap_orphans",
]
