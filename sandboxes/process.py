"""The `process` backend: a plain child process in the workspace. NO ISOLATION.

For development only: the command sees the whole host (network, files, other workspaces)
with the caller's privileges. Creating one logs and warns, and every `RunResult` carries
`isolated=False`. Timeouts, output caps and rlimits still apply.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

from rlsys.sandboxes.config import ProcessSandboxConfig
from rlsys.sandboxes.local import LocalSandbox

logger = logging.getLogger(__name__)

WARNING = "sandbox backend 'process' has NO isolation; use it for development only"


class IsolationWarning(UserWarning):
    """A sandbox was created that does not isolate what it runs."""


class ProcessLauncher:
    backend = "process"
    leader_usage_counts = True  # does wait4 on the launched process cover the command?
    isolated = False
    run_as_uid = None

    def __init__(self, config: ProcessSandboxConfig) -> None:
        self.config = config

    def workspace_dir(self, workspace: Path) -> str:
        return str(workspace)

    def argv(self, workspace: Path, command: list[str], usage_fd: int, info_fd: int) -> list[str]:
        # The command is our direct child (prlimit execs it): wait4 measures it; no wrapper.
        limits = self.config.limits
        cpu = limits.cpu_seconds
        # RLIMIT_NPROC is left out: here it would count every process of the caller's uid.
        return [
            "prlimit",
            f"--cpu={cpu}:{cpu + 1}",
            f"--as={limits.memory_bytes}",
            f"--fsize={limits.max_file_bytes}",
            "--core=0",
            "--",
            *command,
        ]


def open_process_sandbox(config: ProcessSandboxConfig) -> LocalSandbox:
    warnings.warn(WARNING, IsolationWarning, stacklevel=3)
    logger.warning(WARNING)
    return LocalSandbox(ProcessLauncher(config), config.limits, config.workspace_root)
