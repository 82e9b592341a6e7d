"""From the moment a job's row exists until it ends: the driver's heartbeat, and one end.

Invariants:
- entered right after the job row is created (or re-opened by a resume); from then on
  every way out ends the job exactly once, with a status and a one-line reason, and
  `finish_job` names a terminal state for every live rollout: a named end (`end`, or a
  `JobEnd` raised anywhere inside) with its own status; SIGINT/SIGTERM (`KeyboardInterrupt`:
  the CLI maps SIGTERM to it) `stopped`; any other exception `failed`, with the exception
  and the phase it interrupted as the reason, and then re-raised;
- while open, a daemon thread renews the job's heartbeat every `driver_timeout_s / 6`, so a
  driver killed outright reads `orphaned` within the timeout (`rlsys.ledger.liveness`); a
  beat that fails (the database restarting) is simply tried again next period;
- `phase` names what the driver is doing (stream, Ray, actors, warm start, ...), so an
  end that interrupts it says where.
No Ray here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import TracebackType

from rlsys.control.job_end import JobEnd, JobStatus, describe_crash
from rlsys.ledger.reconcile import finish_job
from rlsys.ledger.store import Ledger

HEARTBEATS_PER_TIMEOUT = 6


class JobLifetime:
    def __init__(
        self,
        ledger: Ledger,
        job_id: str,
        driver_timeout_s: float,
        on_phase: Callable[[str], None] | None = None,
    ) -> None:
        self.ledger, self.job_id = ledger, job_id
        self.period_s = driver_timeout_s / HEARTBEATS_PER_TIMEOUT
        self.on_phase = on_phase or (lambda _name: None)
        self.current = "start"
        self.status: JobStatus | None = None
        self.reason: str | None = None
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, daemon=True, name="job-heartbeat")

    def __enter__(self) -> JobLifetime:
        self.ledger.job_heartbeat(self.job_id)
        self._beat.start()
        return self

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.ledger.job_heartbeat(self.job_id)
            except Exception:  # noqa: BLE001 - a missed beat is retried; the timeout has slack
                continue

    def phase(self, name: str) -> None:
        """The driver enters `name`; the caller's hook hears it first."""
        self.current = name
        self.on_phase(name)

    def end(self, status: JobStatus, reason: str | None) -> None:
        """How the job ends when the block exits normally."""
        self.status, self.reason = status, reason

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        _tb: TracebackType | None,
    ) -> bool:
        self._stop.set()
        if isinstance(exc, JobEnd):
            self.end(exc.status, exc.reason)
        elif isinstance(exc, KeyboardInterrupt):
            self.end("stopped", f"interrupted (SIGINT or SIGTERM) during {self.current}")
        elif exc is not None:
            self.end("failed", f"{describe_crash(exc)} (during {self.current})")
        elif self.status is None:
            self.end("failed", f"the driver left {self.current} without an end")
        assert self.status is not None
        finish_job(self.ledger, self.job_id, self.status, self.reason)
        # A named end or an interrupt is an outcome the caller reports; a crash propagates.
        return isinstance(exc, JobEnd | KeyboardInterrupt)
