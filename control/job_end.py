"""A named end of a job, decided by the control loop rather than a crash.

The controller, the planner and the failure handler raise `JobEnd` when the job cannot or
need not go on: the task is solved, no learning signal within the generation bound, every
replica dead, a systematic failure. The driver ends the job with its status and one-line
reason (`finish_job`), and the CLI prints that line, not a traceback. An exception of any
other type is a crash: the job still ends `failed`, with the exception as its reason.
No Ray here.
"""

from __future__ import annotations

from typing import Literal

JobStatus = Literal["completed", "failed", "stopped"]


class JobEnd(Exception):
    """End the job with `status` and a one-line `reason` (shown to the user as is)."""

    def __init__(self, status: JobStatus, reason: str) -> None:
        super().__init__(reason)
        self.status: JobStatus = status
        self.reason = reason


def describe_crash(err: BaseException) -> str:
    """The reason a crashed job ends with: the exception, on one line."""
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}"[:500] if text else type(err).__name__
