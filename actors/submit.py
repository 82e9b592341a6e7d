"""Submitting a job to a Ray cluster through the Ray Jobs API.

The entrypoint is `rlsys run CONFIG --job-id ID` with the working directory as the runtime
env, so the cluster runs exactly the code and config the user has. The job id is chosen
here and used as the Ray submission id too, so `rlsys jobs status|stop ID` can address both
the ledger and the Ray job. Token authentication (on by default in Ray 2.60 clusters) is
picked up by Ray's client from `RAY_AUTH_TOKEN` / `RAY_AUTH_TOKEN_PATH` / its default
token file, as for any Ray tool.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable

from ray.exceptions import AuthenticationError
from ray.job_submission import JobStatus, JobSubmissionClient

from rlsys.ledger.records import new_id

_EXCLUDES = [".venv", "runs", ".git", "__pycache__", "*.egg-info", ".pytest_cache", ".ruff_cache"]


def _client(address: str) -> JobSubmissionClient:
    try:
        return JobSubmissionClient(address)
    except AuthenticationError as err:
        raise ConnectionError(
            "the cluster requires an auth token: set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN "
            "(or RAY_AUTH_TOKEN_PATH) to the cluster's token (`ray get-auth-token` on its head)"
        ) from err


def submit_job(
    address: str,
    config: str,
    sets: tuple[str, ...],
    *,
    follow: bool = False,
    python: str = "python",
    echo: Callable[[str], None] = print,
    runtime_env: dict | None = None,
) -> str:
    client = _client(address)
    job_id = new_id("j")
    args = [python, "-m", "rlsys.cli", "run", config, "--job-id", job_id] + [
        a for s in sets for a in ("--set", s)
    ]
    deadline = time.monotonic() + 300  # a loaded 2-core head can take minutes
    while True:
        try:
            client.submit_job(
                entrypoint=shlex.join(args),
                submission_id=job_id,
                runtime_env=runtime_env or {"working_dir": ".", "excludes": _EXCLUDES},
            )
            break
        except RuntimeError as err:
            # A freshly started head answers before its job agent is up ("No available agent
            # to submit job, please try again later"): retry that, nothing else.
            if "No available agent" not in str(err) or time.monotonic() > deadline:
                raise
            time.sleep(2.0)
    if follow:
        while client.get_job_status(job_id) not in {
            JobStatus.SUCCEEDED,
            JobStatus.FAILED,
            JobStatus.STOPPED,
        }:
            time.sleep(1.0)
        echo(client.get_job_logs(job_id))
    return job_id


def stop_submitted(address: str, job_id: str) -> bool:
    """Ask Ray to stop the submitted job (its driver then ends the job as `stopped`)."""
    return _client(address).stop_job(job_id)


def submitted_status(address: str, job_id: str) -> str:
    return str(_client(address).get_job_status(job_id))
