"""Every command that reads a config refuses a bad one the same way: the one loader and the
one formatter (`rlsys.cli.job_config`, `rlsys.config.errors`), exit 2, one line naming the
field path, nothing started (docs/ARCHITECTURE.md, "Command line")."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from rlsys.cli.main import main

pytestmark = pytest.mark.unit

QUICKSTART = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"

# (what is wrong, field path the error must name); one job section and one section the
# rollout layer owns (a loader that skipped the owned sections would miss the second)
BAD = [
    ({"sampling": {"top_p": 1.5}}, "sampling.top_p: Input should be less than or equal to 1"),
    ({"rollout": {"task": {"max_factor": 0}}}, "rollout.task.max_factor: Input should be"),
    ({"engine": {"replicas": 0}}, "engine.placement.replicas: Input should be greater"),
]
# each command that reads a job config, as a user types it (CONFIG is the file)
COMMANDS = {
    "run": ["run", "CONFIG"],
    "submit": ["submit", "CONFIG", "--address", "http://127.0.0.1:1"],
    "align": ["align", "CONFIG", "--tp", "1"],
}


def _bad_config(tmp_path: Path, change: dict) -> Path:
    data = yaml.safe_load(QUICKSTART.read_text())
    for section, values in change.items():
        for key, value in values.items():
            data[section][key] = (
                {**data[section][key], **value} if isinstance(value, dict) else value
            )
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _exit_code_and_stderr(args: list[str], monkeypatch, capsys) -> tuple[int, str]:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(sys, "argv", ["rlsys", *args])
    with pytest.raises(SystemExit) as exited:
        main()
    return int(exited.value.code), capsys.readouterr().err


@pytest.mark.parametrize("change, message", BAD, ids=["sampling", "owned-section", "placement"])
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_bad_config_exits_2_naming_the_field(
    command, change, message, tmp_path, monkeypatch, capsys
) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("RLSYS_RUN_ROOT", str(tmp_path / "runs"))
    config = _bad_config(tmp_path, change)
    args = [str(config) if a == "CONFIG" else a for a in COMMANDS[command]]
    code, err = _exit_code_and_stderr(args, monkeypatch, capsys)
    assert code == 2
    [line] = err.strip().splitlines()
    assert line.startswith("error: invalid config: ") and message in line
    assert not (tmp_path / "runs").exists()  # nothing started, nothing written


def test_model_overrides_go_through_the_same_formatter(monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    code, err = _exit_code_and_stderr(
        ["model", "info", "tiny", "--set", "n_layers=0"], monkeypatch, capsys
    )
    assert code == 2
    assert err.startswith("error: invalid config: model.n_layers: Input should be greater")
