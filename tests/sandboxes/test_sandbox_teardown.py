"""No leaks: nothing a sandbox started outlives its command, its `close`, or its owner.

The crash case is real: a separate Python process opens a bwrap sandbox, starts a command
and is SIGKILLed; its sandbox processes must die with it, and the start-up reaper must
remove the workspace it left behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from rlsys.sandboxes.config import BwrapSandboxConfig, ProcessSandboxConfig, SandboxLimits
from rlsys.sandboxes.process import IsolationWarning
from rlsys.sandboxes.reaper import reap_orphans
from rlsys.sandboxes.registry import open_sandbox
from tests.sandboxes.conftest import bwrap_usable

pytestmark = pytest.mark.unit


@pytest.fixture
def root():
    if (reason := bwrap_usable()) is not None:
        pytest.skip(f"bwrap unusable here: {reason}")
    path = Path(tempfile.gettempdir()) / f"rlsys-test-{uuid.uuid4().hex[:8]}"
    yield path
    subprocess.run(["rm", "-rf", str(path)], check=False)


def _pids_with_arg(marker: str) -> list[int]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if marker.encode() in cmdline.read_bytes().split(b"\0"):
                found.append(int(cmdline.parent.name))
        except OSError:
            continue
    return found


# How long a killed process may take to be gone: SIGKILL is delivered when the process is
# next scheduled, which on a loaded 2-core box can take seconds. The wait ends as soon as
# the processes are gone; the bound only turns a leak into a failure instead of a hang.
GONE_S = 120.0


def _wait_until(predicate, timeout_s: float) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_background_processes_die_with_their_command(root: Path) -> None:
    marker = str(3000 + os.getpid() % 1000)  # a sleep duration no one else uses
    with open_sandbox(BwrapSandboxConfig(workspace_root=root)) as box:
        result = box.run(f"sleep {marker} & sleep {marker} & setsid sleep {marker} & echo ok")
        assert result.ok and result.stdout == b"ok\n"
        assert _pids_with_arg(marker) == []


def test_timed_out_command_leaves_no_process(root: Path) -> None:
    marker = str(4000 + os.getpid() % 1000)
    with open_sandbox(BwrapSandboxConfig(workspace_root=root)) as box:
        result = box.run(f"sleep {marker} & sleep {marker}", timeout_s=0.5)
        assert result.killed_reason == "timeout"
        assert _pids_with_arg(marker) == []


def test_close_removes_the_workspace(root: Path) -> None:
    box = open_sandbox(BwrapSandboxConfig(workspace_root=root))
    box.write_file("a/b/c.txt", "x")
    folder = box.workspace.root
    assert folder.is_dir()
    box.close()
    box.close()  # idempotent
    assert not folder.exists()


def test_owner_sigkill_kills_its_sandbox_and_reaper_cleans_up(root: Path) -> None:
    marker = str(5000 + os.getpid() % 1000)
    script = textwrap.dedent(f"""
        from pathlib import Path
        from rlsys.sandboxes.config import BwrapSandboxConfig, SandboxLimits
        from rlsys.sandboxes.registry import open_sandbox
        box = open_sandbox(BwrapSandboxConfig(workspace_root=Path({str(root)!r}),
                                              limits=SandboxLimits(wall_timeout_s=600)))
        box.run("sleep {marker} & sleep {marker}")
    """)
    owner = subprocess.Popen([sys.executable, "-c", script])
    try:
        # the owner imports rlsys first: slow on a loaded 2-core box, hence a generous bound
        started = _wait_until(lambda: len(_pids_with_arg(marker)) == 2, 90.0)
        assert started, "sandbox never started"
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
    assert _wait_until(lambda: _pids_with_arg(marker) == [], GONE_S), "sandbox outlived its owner"
    (orphan,) = list(root.iterdir())
    report = reap_orphans(root)
    assert report.removed_workspaces == [orphan.name]
    assert not orphan.exists()


def test_reaper_leaves_a_live_owners_sandbox_alone(root: Path) -> None:
    with open_sandbox(BwrapSandboxConfig(workspace_root=root)) as box:
        assert reap_orphans(root).removed_workspaces == []
        assert box.workspace.root.exists()


def test_process_backend_warns_and_kills_its_group_on_timeout(tmp_path: Path) -> None:
    marker = str(6000 + os.getpid() % 1000)
    limits = SandboxLimits(wall_timeout_s=0.5)
    with pytest.warns(IsolationWarning):
        box = open_sandbox(ProcessSandboxConfig(workspace_root=tmp_path, limits=limits))
    with box:
        result = box.run(f"sleep {marker} & sleep {marker}")
        assert result.killed_reason == "timeout" and not result.isolated
        # no pid namespace here: SIGKILL to the group is delivered asynchronously, and the
        # orphaned sleep may take a moment to die on a loaded machine
        assert _wait_until(lambda: _pids_with_arg(marker) == [], GONE_S)
        assert box.run(["python3", "-c", "print(2 + 2)"]).stdout == b"4\n"
