"""A docker sandbox names a SIGKILL it did not send, even when the engine's OOM flag is late.

The engine (not under test here: a stand-in container reports its state) sets
`State.OOMKilled` from the kernel's OOM event, which can arrive after the exit under load;
the backend polls for it, and without it names the kill by the only senders left.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("docker")

from rlsys.sandboxes import docker_backend  # noqa: E402
from rlsys.sandboxes.config import SandboxLimits  # noqa: E402


class _Container:
    """Reports `ExitCode` 137, and OOMKilled from its `late`-th reload on (never if None)."""

    def __init__(self, late: int | None) -> None:
        self.late, self.reloads = late, 0
        self.attrs: dict[str, Any] = {"State": {"ExitCode": 137, "OOMKilled": False}}

    def reload(self) -> None:
        self.reloads += 1
        oom = self.late is not None and self.reloads >= self.late
        self.attrs = {"State": {"ExitCode": 137, "OOMKilled": oom}}


def test_a_late_oom_flag_is_waited_for() -> None:
    box = _Container(late=3)
    limits = SandboxLimits(cpu_seconds=5)
    reason = docker_backend._sigkill_reason(box, box.attrs["State"], 0.3, limits)
    assert reason == "memory" and box.reloads == 3


@pytest.mark.parametrize(("wall_s", "want"), [(0.3, "memory"), (6.0, "cpu")])
def test_without_the_flag_the_kill_is_named_by_when_it_came(
    monkeypatch: pytest.MonkeyPatch, wall_s: float, want: str
) -> None:
    monkeypatch.setattr(docker_backend, "OOM_FLAG_WAIT_S", 0.2)
    box = _Container(late=None)
    limits = SandboxLimits(cpu_seconds=5)
    assert docker_backend._sigkill_reason(box, box.attrs["State"], wall_s, limits) == want
    assert box.reloads >= 1  # it did look again before inferring
