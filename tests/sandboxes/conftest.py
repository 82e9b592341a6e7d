"""Sandbox fixtures: a factory per backend with small limits and a private workspace root.

The docker backend needs a running engine and the local image built by
scripts/build_sandbox_image.sh; without them its tests skip and say why.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from rlsys.sandboxes.base import Sandbox
from rlsys.sandboxes.config import (
    BwrapSandboxConfig,
    DockerSandboxConfig,
    SandboxLimits,
)

SMALL = dict(wall_timeout_s=10.0, cpu_seconds=2, memory_bytes=256 << 20, max_processes=32)


def bwrap_usable() -> str | None:
    """None when bwrap can create its namespaces here, else why not."""
    from rlsys.sandboxes.bwrap import find_bwrap

    probe = [
        str(find_bwrap(BwrapSandboxConfig())),
        "--unshare-all",
        "--unshare-user",
        "--ro-bind",
        "/usr",
        "/usr",
        "--symlink",
        "usr/bin",
        "/bin",
        "--symlink",
        "usr/lib",
        "/lib",
        "--symlink",
        "usr/lib64",
        "/lib64",
        "/usr/bin/true",
    ]
    user = 65534 if os.geteuid() == 0 else None
    done = subprocess.run(probe, capture_output=True, user=user, group=user)
    return None if done.returncode == 0 else done.stderr.decode(errors="replace").strip()


def docker_unusable_reason() -> str | None:
    try:
        from rlsys.sandboxes.docker_backend import connect
    except ImportError:
        return "docker-py is not installed (pip install 'rlsys[docker]')"
    from rlsys.sandboxes.base import SandboxError

    try:
        client = connect()
    except SandboxError as err:
        return str(err)
    if not client.images.list(name=DockerSandboxConfig().image):
        return f"image {DockerSandboxConfig().image} missing: run scripts/build_sandbox_image.sh"
    return None


BACKEND_PARAMS = [
    pytest.param("bwrap", marks=pytest.mark.unit),
    pytest.param("docker", marks=pytest.mark.services),
]


@pytest.fixture
def make_sandbox(
    request: pytest.FixtureRequest,
) -> Iterator[Callable[..., Sandbox]]:
    """`make_sandbox(**limits)` opens a sandbox of the parametrized backend; all are closed."""
    backend = getattr(request, "param", "bwrap")
    reason = bwrap_usable() if backend == "bwrap" else docker_unusable_reason()
    if reason is not None:
        pytest.skip(f"{backend} backend unusable here: {reason}")
    from rlsys.sandboxes.registry import open_sandbox

    opened: list[Sandbox] = []
    # Not under tmp_path: pytest makes that 0700, and bwrap runs as an unprivileged uid.
    root = Path(tempfile.gettempdir()) / f"rlsys-test-{uuid.uuid4().hex[:8]}"

    def make(**limits: Any) -> Sandbox:
        config_cls = {"bwrap": BwrapSandboxConfig, "docker": DockerSandboxConfig}[backend]
        config = config_cls(limits=SandboxLimits(**{**SMALL, **limits}), workspace_root=root)
        box = open_sandbox(config)
        opened.append(box)
        return box

    yield make
    for box in opened:
        box.close()
    shutil.rmtree(root, ignore_errors=True)
