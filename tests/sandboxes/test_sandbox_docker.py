"""Docker backend leaks: no container outlives `run`/`close`; the reaper removes containers
whose owner died. The containment contract itself runs in test_sandbox_containment.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.sandboxes.conftest import docker_unusable_reason

pytestmark = pytest.mark.services


@pytest.fixture
def client():
    if (reason := docker_unusable_reason()) is not None:
        pytest.skip(f"docker backend unusable here: {reason}")
    from rlsys.sandboxes.docker_backend import connect

    return connect()


def _ours(client) -> list:  # type: ignore[no-untyped-def]
    return client.containers.list(all=True, filters={"label": "rlsys.sandbox"})


def test_no_container_outlives_run_or_close(client, tmp_path) -> None:
    from rlsys.sandboxes.config import DockerSandboxConfig
    from rlsys.sandboxes.registry import open_sandbox

    before = {c.id for c in _ours(client)}
    with open_sandbox(DockerSandboxConfig(workspace_root=tmp_path / "ws")) as box:
        assert box.run(["sleep", "60"], timeout_s=1).killed_reason == "timeout"
        assert {c.id for c in _ours(client)} == before
    assert {c.id for c in _ours(client)} == before


def test_reaper_removes_containers_of_a_dead_owner(client) -> None:
    from rlsys.sandboxes.config import DockerSandboxConfig
    from rlsys.sandboxes.docker_backend import LABEL, owner_labels, reap_containers

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    labels = {**owner_labels(), f"{LABEL}.pid": dead.stdout.strip()}
    orphan = client.containers.create(
        DockerSandboxConfig().image, ["sleep", "600"], labels=labels, network_mode="none"
    )
    alive = client.containers.create(
        DockerSandboxConfig().image, ["sleep", "600"], labels=owner_labels(), network_mode="none"
    )
    try:
        removed = reap_containers()
        assert orphan.id in removed and alive.id not in removed
    finally:
        alive.remove(force=True)
