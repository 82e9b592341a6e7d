"""The learning check (test_learning.py) runs in a process of its own, started as soon as
the session's tests are collected, so that its minutes of CPU overlap with the rest of the
suite: most tests keep one core of the two busy (pytest runs them one at a time), and the
learning run takes up the other (one torch thread: `--threads 1` in its arguments). Its
result does not depend on timing (staleness 0, paired evaluation), and the test waits for
it, bounded by the test's own timeout.

`RLSYS_LEARNING_IN_PROCESS=1` runs it inside the test instead, when the test runs.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
PR_SET_PDEATHSIG = 1  # linux/prctl.h
_BACKGROUND: dict[str, Any] = {}


def pytest_collection_finish(session: pytest.Session) -> None:
    if os.environ.get("RLSYS_LEARNING_IN_PROCESS") == "1" or session.config.option.collectonly:
        return
    if not any(item.path.name == "test_learning.py" for item in session.items):
        return
    from tests.trainer.test_learning import harness_command

    folder = Path(tempfile.mkdtemp(prefix="rlsys-learning-"))
    log = (folder / "log").open("w")
    proc = subprocess.Popen(
        harness_command(folder / "result.json"),
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        preexec_fn=_die_with_parent,
    )
    _BACKGROUND.update(proc=proc, folder=folder, log=log)


def _die_with_parent() -> None:
    # a pytest killed outright (no sessionfinish) must not leave minutes of CPU running
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def pytest_sessionfinish(session: pytest.Session) -> None:
    proc = _BACKGROUND.get("proc")
    if proc is None:
        return
    if proc.poll() is None:  # the session ended before the learning test read it
        proc.kill()
        proc.wait()
    _BACKGROUND["log"].close()
    shutil.rmtree(_BACKGROUND["folder"], ignore_errors=True)


def learning_result() -> dict[str, Any] | None:
    """The background run's result, once it has finished; None when none was started."""
    proc = _BACKGROUND.get("proc")
    if proc is None:
        return None
    code = proc.wait()  # bounded by the learning test's timeout
    folder = _BACKGROUND["folder"]
    if code != 0:
        tail = (folder / "log").read_text()[-4000:]
        raise AssertionError(f"the learning run exited {code}:\n{tail}")
    sys.stdout.write((folder / "log").read_text())  # its curve, shown with -s or on failure
    return json.loads((folder / "result.json").read_text())
