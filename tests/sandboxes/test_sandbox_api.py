"""Config validation, the registry, host-side file access and the `rlsys sandbox` command."""

from __future__ import annotations

import asyncio
import json
import tempfile
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner
from pydantic import ValidationError

from rlsys.cli.errors import UserError
from rlsys.cli.sandbox_cmd import BACKEND_NAMES, sandbox
from rlsys.sandboxes.async_sandbox import AsyncSandbox
from rlsys.sandboxes.base import Sandbox, SandboxError
from rlsys.sandboxes.config import BwrapSandboxConfig, SandboxLimits
from rlsys.sandboxes.registry import BACKENDS, open_sandbox, parse_sandbox_config
from tests.sandboxes.conftest import bwrap_usable

pytestmark = pytest.mark.unit


@pytest.fixture
def root():
    if (reason := bwrap_usable()) is not None:
        pytest.skip(f"bwrap unusable here: {reason}")
    path = Path(tempfile.gettempdir()) / f"rlsys-test-{uuid.uuid4().hex[:8]}"
    yield path
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def test_config_rejects_unknown_fields_and_private_binds() -> None:
    with pytest.raises(ValidationError):
        SandboxLimits(cpu_secs=3)
    for bad in ("/", "/root", "/home/user", str(Path.home()), "usr"):
        with pytest.raises(ValidationError):
            BwrapSandboxConfig(system_binds=(bad,))


def test_parse_picks_the_backend_by_type() -> None:
    config = parse_sandbox_config({"type": "process", "limits": {"cpu_seconds": 3}})
    assert config.type == "process" and config.limits.cpu_seconds == 3
    with pytest.raises(ValidationError):
        parse_sandbox_config({"type": "vm"})


def test_cli_backend_names_match_the_registry() -> None:
    assert set(BACKEND_NAMES) == set(BACKENDS)


def test_host_side_file_access_refuses_escapes_and_symlinks(root: Path) -> None:
    with open_sandbox(BwrapSandboxConfig(workspace_root=root)) as box:
        assert isinstance(box, Sandbox)
        box.write_file("/workspace/dir/x.txt", b"\x00\xff")
        assert box.read_file("dir/x.txt") == b"\x00\xff"
        assert box.run(["ln", "-s", "/etc/hostname", "leak"]).ok  # planted by sandboxed code
        with pytest.raises(OSError):
            box.read_file("leak")
        for escape in ("../owner.json", "/etc/passwd", "dir/../../owner.json"):
            with pytest.raises(SandboxError):
                box.read_file(escape)
    with pytest.raises(SandboxError):
        box.run(["true"])


def test_async_sandbox_runs_commands(root: Path) -> None:
    async def go() -> bytes:
        async with AsyncSandbox(open_sandbox(BwrapSandboxConfig(workspace_root=root))) as box:
            await box.write_file("in.txt", "41")
            result = await box.run("python3 -c 'print(int(open(\"in.txt\").read()) + 1)'")
            return result.stdout

    assert asyncio.run(go()) == b"42\n"


def test_cli_runs_a_command_and_reports_usage(root: Path) -> None:
    result = CliRunner().invoke(
        sandbox, ["run", "--backend", "bwrap", "--json", "--", "sh", "-c", "echo hi; exit 3"]
    )
    assert result.exit_code == 3
    data = json.loads(result.output)
    assert data["stdout"] == "hi\n" and data["exit_code"] == 3 and data["isolated"] is True
    assert data["cpu_s"] is not None and data["wall_s"] > 0
    human = CliRunner().invoke(sandbox, ["run", "--", "python3", "-c", "print(6 * 7)"])
    assert human.exit_code == 0 and "42" in human.output and "exit_code=0" in human.output


def test_cli_unknown_backend_is_a_user_error() -> None:
    result = CliRunner().invoke(sandbox, ["run", "--backend", "qemu", "--", "true"])
    assert isinstance(result.exception, UserError)
    assert "bwrap" in str(result.exception) and "docker" in str(result.exception)
