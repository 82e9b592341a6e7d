"""Hostile tool code is contained: output floods, binary output, loops, fork bombs,
memory hogs, writes outside the workspace, network, host files, and neighbouring sandboxes.

Each test runs against bwrap (unit: CI on this machine) and docker (services: where an
engine and the local image exist, else skipped with the reason).
"""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import uuid
from pathlib import Path

import pytest

from tests.sandboxes.conftest import BACKEND_PARAMS

backends = pytest.mark.parametrize("make_sandbox", BACKEND_PARAMS, indirect=True)
REPO = Path(__file__).resolve().parents[2]


@backends
def test_hundred_megabytes_of_output_is_capped_and_killed(make_sandbox) -> None:
    box = make_sandbox(max_output_bytes=1 << 20)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = box.run("head -c 100000000 /dev/zero; echo done >&2")
    assert result.killed_reason == "output_cap"
    assert len(result.stdout) == 1 << 20 and result.stdout_truncated
    growth_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    assert growth_mib < 32, f"host memory grew by {growth_mib:.0f} MiB"


@backends
def test_output_past_the_cap_can_be_drained_instead_of_killed(make_sandbox) -> None:
    box = make_sandbox(max_output_bytes=4096, on_output_overflow="truncate")
    result = box.run("head -c 100000000 /dev/zero; echo finished >&2")
    assert result.exit_code == 0 and result.killed_reason is None
    assert len(result.stdout) == 4096 and result.stdout_truncated
    assert result.stderr == b"finished\n" and not result.stderr_truncated


@backends
def test_binary_output_is_kept_byte_exact(make_sandbox) -> None:
    payload = bytes(range(256)) * 16
    result = make_sandbox().run(
        ["python3", "-c", "import sys; sys.stdout.buffer.write(bytes(range(256)) * 16)"]
    )
    assert result.ok and result.stdout == payload
    assert "\ufffd" in result.summary()["stdout"]  # JSON view replaces invalid UTF-8


@backends
def test_infinite_loop_is_stopped_by_the_cpu_limit(make_sandbox) -> None:
    result = make_sandbox(cpu_seconds=1, wall_timeout_s=20).run(["python3", "-c", "while 1: pass"])
    assert result.killed_reason == "cpu"
    assert result.wall_s < 15


@backends
def test_sleeping_command_is_stopped_by_the_wall_timeout(make_sandbox) -> None:
    result = make_sandbox().run(["sleep", "600"], timeout_s=1.0)
    assert result.killed_reason == "timeout" and result.exit_code != 0
    assert result.wall_s < 8


@backends
def test_fork_bomb_is_contained_and_host_can_still_fork(make_sandbox) -> None:
    box = make_sandbox(max_processes=32)
    count = "import os, time\nn = 0\ntry:\n    while n < 1000:\n        if os.fork() == 0:\n"
    count += "            time.sleep(5); os._exit(0)\n        n += 1\nexcept OSError:\n    print(n)"
    forked = box.run(["python3", "-c", count], timeout_s=5)
    assert forked.exit_code == 0 and 0 < int(forked.stdout) < 32  # the pids limit bit
    # Every process keeps forking and spinning until the sandbox is torn down.
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    result = box.run(["python3", "-c", bomb], timeout_s=3)
    assert result.killed_reason in ("timeout", "cpu")
    assert result.wall_s < 10
    assert subprocess.run(["true"]).returncode == 0  # host unaffected
    if os.geteuid() == 0 and box.backend == "bwrap":
        left = _processes_of_uid(65534)
        assert left == [], [Path(f"/proc/{p}/cmdline").read_bytes() for p in left]


@backends
def test_memory_hog_hits_the_memory_limit(make_sandbox) -> None:
    result = make_sandbox(memory_bytes=128 << 20).run(
        ["python3", "-c", "x = bytearray(1 << 30); print('allocated')"]
    )
    assert result.killed_reason == "memory"
    assert b"allocated" not in result.stdout


@backends
def test_writes_outside_the_workspace_are_refused(make_sandbox) -> None:
    box = make_sandbox()
    name = f"rlsys-probe-{uuid.uuid4().hex}"
    for target in (f"/usr/{name}", f"/{name}", f"/etc/{name}", f"/bin/{name}"):
        result = box.run(["sh", "-c", f"echo x > {target}"])
        assert result.exit_code != 0, target
        assert not Path(target).exists(), f"{target} appeared on the host"
    # /tmp is writable but private: nothing reaches the host's /tmp.
    assert box.run(["sh", "-c", f"echo x > /tmp/{name}"]).ok
    assert not Path(f"/tmp/{name}").exists()
    assert box.run(["sh", "-c", f"echo x > /workspace/{name}"]).ok
    assert box.read_file(name) == b"x\n"


@backends
def test_network_connections_fail(make_sandbox) -> None:
    probe = (
        "import socket, sys\n"
        "for addr in [('127.0.0.1', 6379), ('1.1.1.1', 53)]:\n"
        "    try:\n"
        "        socket.create_connection(addr, timeout=2); print('CONNECTED', addr)\n"
        "    except OSError as e:\n"
        "        print('FAILED', addr, e)\n"
    )
    result = make_sandbox().run(["python3", "-c", probe])
    assert result.exit_code == 0, result.stderr_text
    assert b"CONNECTED" not in result.stdout
    if _host_connects("127.0.0.1", 6379):  # Redis answers on the host, not inside
        assert result.stdout.count(b"FAILED") == 2


@backends
def test_host_home_project_and_environment_are_absent(make_sandbox, monkeypatch) -> None:
    monkeypatch.setenv("RLSYS_HOST_SECRET", "hunter2")
    box = make_sandbox()
    for path in (str(Path.home()), "/home", str(REPO), str(REPO / "pyproject.toml")):
        result = box.run(["ls", path])
        assert result.exit_code != 0, f"{path} visible: {result.stdout_text}"
    assert b"hunter2" not in box.run(["env"]).stdout


@backends
def test_two_sandboxes_cannot_see_each_others_workspace(make_sandbox) -> None:
    first, second = make_sandbox(), make_sandbox()
    first.write_file("secret.txt", "only-for-first")
    host_path = str(first.workspace.path)
    listing = second.run(["sh", "-c", f"ls /workspace; cat {host_path}/secret.txt; ls /tmp"])
    assert b"only-for-first" not in listing.stdout + listing.stderr
    assert b"secret.txt" not in listing.stdout
    leak = second.run(["sh", "-c", "find / -name secret.txt 2>/dev/null"], timeout_s=20)
    assert b"secret.txt" not in leak.stdout


def _processes_of_uid(uid: int) -> list[int]:
    """Host processes running as `uid`, leaving out docker containers (the docker params)."""
    pids = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            lines = status.read_text().splitlines()
            if "docker" in (status.parent / "cgroup").read_text():
                continue
        except OSError:
            continue
        uid_line = next((ln for ln in lines if ln.startswith("Uid:")), "")
        if uid_line.split()[1:2] == [str(uid)]:
            pids.append(int(status.parent.name))
    return pids


def _host_connects(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False
