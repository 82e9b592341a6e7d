"""`rlsys run` as a user runs it: a subprocess in its own session (its own local Ray), its
output read line by line, so a test can wait for a line and then signal or kill it."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

RLSYS = [sys.executable, "-m", "rlsys.cli"]


class CliJob:
    """One `rlsys run CONFIG --set ... --json` process: its progress lines and events come on
    stderr (collected as they come), its summary object on stdout."""

    def __init__(self, *args: str, cwd: Path) -> None:
        self.proc = subprocess.Popen(
            [*RLSYS, "run", *args, "--json"],
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its own process group: the driver and its Ray head
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.stderr: list[str] = []
        self.stdout: list[str] = []
        self._readers = [
            threading.Thread(target=self._read_stderr, daemon=True),
            threading.Thread(target=self._read_stdout, daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr.append(line)
            self.lines.put(line)

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        self.stdout.extend(self.proc.stdout)

    def wait_for_line(self, prefix: str, timeout_s: float = 600) -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                line = ""
            if line.startswith(prefix):
                return line
            if time.monotonic() > deadline or (not line and self.proc.poll() is not None):
                raise AssertionError(f"no line {prefix!r}; stderr:\n{''.join(self.stderr)[-4000:]}")

    def job_id(self) -> str:
        return self.wait_for_line("job j-").split()[1].rstrip(":")

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def kill_group(self) -> None:
        """SIGKILL the driver and everything of its session (its local Ray cluster)."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=60)

    def finish(self, timeout_s: float = 900) -> tuple[int, str, str]:
        """Wait for the process to end; its exit code, stdout and stderr."""
        self.proc.wait(timeout=timeout_s)
        for reader in self._readers:
            reader.join(timeout=60)
        return self.proc.returncode, "".join(self.stdout), "".join(self.stderr)


def rlsys_json(*args: str, cwd: Path) -> Any:
    """An `rlsys` command's `--json` output: its object, or a list of one per line."""
    done = subprocess.run(
        [*RLSYS, *args, "--json"], cwd=cwd, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    return json.loads(lines[0]) if len(lines) == 1 else [json.loads(x) for x in lines]
