"""Backend registry: `type` -> a function that opens a sandbox from its config.

Invariant: importing this module imports no backend's third-party client; the docker
backend (and docker-py) is imported only when a docker sandbox is opened.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import TypeAdapter

from rlsys.sandboxes.base import Sandbox
from rlsys.sandboxes.bwrap import open_bwrap_sandbox
from rlsys.sandboxes.config import (
    BwrapSandboxConfig,
    DockerSandboxConfig,
    ProcessSandboxConfig,
    SandboxConfig,
)
from rlsys.sandboxes.process import open_process_sandbox


def _open_docker_sandbox(config: DockerSandboxConfig) -> Sandbox:
    from rlsys.sandboxes.docker_backend import DockerSandbox

    return DockerSandbox(config)


BACKENDS: dict[str, Callable[[Any], Sandbox]] = {
    "bwrap": open_bwrap_sandbox,
    "process": open_process_sandbox,
    "docker": _open_docker_sandbox,
}

_CONFIG_ADAPTER: TypeAdapter[Any] = TypeAdapter(SandboxConfig)


def parse_sandbox_config(
    data: dict[str, Any],
) -> BwrapSandboxConfig | ProcessSandboxConfig | DockerSandboxConfig:
    """Validate a plain dict (e.g. from YAML) into the backend config its `type` names."""
    return _CONFIG_ADAPTER.validate_python(data)


def open_sandbox(config: SandboxConfig | None = None) -> Sandbox:
    """Open a sandbox of the configured backend (default: bwrap with default limits)."""
    config = config if config is not None else BwrapSandboxConfig()
    return BACKENDS[config.type](config)
