"""A job on a Ray cluster through the Ray Jobs API: submit, status, stop, logs.

The entrypoint is `rlsys run CONFIG --job-id ID` with the working directory as the runtime
env, so the cluster runs exactly the code and config the user has. The job id is chosen
here and used as the Ray submission id too, so `rlsys jobs status|stop|logs ID` address
both the ledger and the Ray job. The job's environment carries the ledger URL the user's
shell resolved (so both read and write the same ledger). Token authentication (on by
default in Ray 2.60 clusters) is picked up by Ray's client from `RAY_AUTH_TOKEN` /
`RAY_AUTH_TOKEN_PATH` / its default token file, as for any Ray tool.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ray.exceptions import AuthenticationError
from ray.job_submission import JobStatus, JobSubmissionClient

from rlsys.ledger.records import new_id

_EXCLUDES = [
    ".venv",
    "runs",
    ".git",
    "__pycache__",
    "*.egg-info",
    ".pytest_cache",
    ".ruff_cache",
    "wandb",
    "mlruns",
]
# What every submitted driver's environment gets besides the ledger URL.
JOB_ENV = {
    # progress lines reach `rlsys jobs logs --follow` as they are printed, not at exit
    "PYTHONUNBUFFERED": "1",
    # `jobs stop` sends SIGTERM; the driver then ends the job in the ledger and tears its
    # actors down, which takes longer than Ray's default 3 s before SIGKILL
    "RAY_JOB_STOP_WAIT_TIME_S": "60",
}
TERMINAL = {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}


@contextmanager
def _address_from_caller() -> Iterator[None]:
    # Ray's client lets RAY_API_SERVER_ADDRESS / RAY_ADDRESS override the address it is
    # given; the CLI has already applied that precedence, so an explicit --address wins.
    saved = {
        k: os.environ.pop(k) for k in ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS") if k in os.environ
    }
    try:
        yield
    finally:
        os.environ.update(saved)


def _client(address: str) -> JobSubmissionClient:
    try:
        with _address_from_caller():
            return JobSubmissionClient(address)
    except AuthenticationError as err:
        raise ConnectionError(
            "the cluster requires an auth token: set RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH) "
            "to the cluster's token (`ray get-auth-token` on its head)"
        ) from err


def submit_job(
    address: str,
    config: str,
    sets: tuple[str, ...],
    *,
    ledger_url: str,
    follow: bool = False,
    python: str = "python",
    echo: Callable[[str], None] = print,
) -> str:
    """Submit `rlsys run CONFIG` writing to `ledger_url`; returns the job id."""
    client = _client(address)
    job_id = new_id("j")
    args = [python, "-m", "rlsys.cli", "run", config, "--job-id", job_id] + [
        a for s in sets for a in ("--set", s)
    ]
    runtime_env = {
        "working_dir": ".",
        "excludes": _EXCLUDES,
        "env_vars": {**JOB_ENV, "RLSYS_LEDGER_URL": ledger_url},
    }
    deadline = time.monotonic() + 300  # a loaded 2-core head can take minutes
    while True:
        try:
            client.submit_job(
                entrypoint=shlex.join(args), submission_id=job_id, runtime_env=runtime_env
            )
            break
        except RuntimeError as err:
            # A freshly started head answers before its job agent is up ("No available agent
            # to submit job, please try again later"): retry that, nothing else.
            if "No available agent" not in str(err) or time.monotonic() > deadline:
                raise
            time.sleep(2.0)
    if follow:
        follow_logs(address, job_id, echo, client=client)
    return job_id


def _unknown_job(err: RuntimeError) -> bool:
    return "status code 404" in str(err)


def submitted_status(address: str, job_id: str) -> str | None:
    """Ray's status of the job, or None when this cluster has no such job."""
    try:
        return str(_client(address).get_job_status(job_id))
    except RuntimeError as err:
        if _unknown_job(err):
            return None
        raise


def stop_submitted(address: str, job_id: str) -> bool | None:
    """Ask Ray to stop the job (SIGTERM to its driver, which ends the job as `stopped`).

    Returns whether a running job was stopped, or None when this cluster has no such job.
    """
    try:
        return _client(address).stop_job(job_id)
    except RuntimeError as err:
        if _unknown_job(err):
            return None
        raise


def job_logs(address: str, job_id: str) -> str | None:
    """The driver's output so far, or None when this cluster has no such job."""
    try:
        return _client(address).get_job_logs(job_id)
    except RuntimeError as err:
        if _unknown_job(err):
            return None
        raise


def follow_logs(
    address: str,
    job_id: str,
    echo: Callable[[str], None],
    *,
    client: JobSubmissionClient | None = None,
) -> str:
    """Print the driver's output as it comes until the job ends; returns Ray's end status."""
    client = client or _client(address)

    async def tail() -> None:
        async for chunk in client.tail_job_logs(job_id):
            echo(chunk)

    asyncio.run(tail())
    # the log stream closes when the driver exits, a moment before Ray records the end
    deadline = time.monotonic() + 30
    while (status := client.get_job_status(job_id)) not in TERMINAL:
        if time.monotonic() > deadline:
            break
        time.sleep(0.5)
    return str(status)
