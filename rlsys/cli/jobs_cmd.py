"""`rlsys jobs list|status|stop|reap|logs`: jobs as the ledger knows them, and as Ray does
when they were submitted to a cluster.

The ledger is found by the one rule (`--db`, else `RLSYS_LEDGER_URL`, else the run root's
SQLite file); the cluster by Ray's (`--address`, else `RAY_API_SERVER_ADDRESS`, else
`RAY_ADDRESS`). A job the cluster does not know (a local run) is served by the ledger alone.

`stop` of a job running on the cluster asks Ray to stop it: Ray sends its driver SIGTERM,
the driver cancels the in-flight rollouts and ends the job as `stopped` in the ledger, and
Ray records it STOPPED. Any other running job is asked through the ledger: its row is set
to `stopping` and its controller sees that within a second. Either way a rollout in flight
ends `cancelled`, and `lost` stays 0.

A job whose driver died (SIGKILL, a lost node) stops renewing its heartbeat and reads
`orphaned` (`rlsys.ledger.liveness`); its live rollouts count as lost. `reap` ends them
`failed_driver_lost` and the job `failed`; `rlsys run CONFIG --resume JOB` continues it.
"""

from __future__ import annotations

import time
from types import ModuleType
from typing import Any

import click

from rlsys.cli.cluster_address import ADDRESS_HELP, cluster_address, require_cluster_address
from rlsys.cli.errors import UserError
from rlsys.cli.ledger_cmd import DB_HELP, _reader

LIVE = ("running", "stopping")


def _ray_jobs() -> ModuleType:
    """The Jobs API helpers, with token auth decided before Ray is imported."""
    from rlsys.cli.ray_auth import enable_token_auth_if_available

    enable_token_auth_if_available()
    from rlsys.actors import submit

    return submit


def _on_cluster(address: str, call: Any, *args: Any) -> Any:
    try:
        return call(address, *args)
    except ConnectionError as err:
        raise UserError(f"cannot reach the Ray Jobs API at {address}: {err}") from err


@click.group()
def jobs() -> None:
    """List jobs, show one job's accounting, stop a running job, or show its output."""


@jobs.command("list")
@click.option("--db", default=None, help=DB_HELP)
@click.option("--json", "as_json", is_flag=True)
def list_(db: str | None, as_json: bool) -> None:
    """Recent jobs in this ledger."""
    from rlsys.cli.render import print_json, print_table
    from rlsys.ledger.queries import list_jobs

    with _reader(db) as ledger:
        rows = list_jobs(ledger)
    if as_json:
        print_json(rows)
        return
    print_table(
        "jobs",
        ["job", "name", "status", "why it ended", "rollouts"],
        [(r["id"], r["name"], r["status"], r["end_reason"] or "", r["rollouts"]) for r in rows],
    )


@jobs.command()
@click.argument("job_id")
@click.option("--db", default=None, help=DB_HELP)
@click.option("--address", default=None, help=ADDRESS_HELP)
@click.option("--json", "as_json", is_flag=True)
def status(job_id: str, db: str | None, address: str | None, as_json: bool) -> None:
    """A job's status and accounting (expected, consumed, dropped, lost, drop rate), and
    Ray's status of it (`ray_status`, null when the cluster has no such job)."""
    from rlsys.cli.render import print_json, print_table
    from rlsys.ledger.queries import stats

    out: dict = {}
    address = cluster_address(address)
    if address:
        out["ray_status"] = _on_cluster(address, _ray_jobs().submitted_status, job_id)
    try:
        with _reader(db) as ledger:
            out.update(stats(ledger, job_id))
    except UserError:
        if out.get("ray_status") is None:
            raise
    if as_json:
        print_json(out)
        return
    print_table(
        f"job {job_id}", ["key", "value"], [(k, v) for k, v in out.items() if k != "terminal"]
    )


@jobs.command()
@click.argument("job_id")
@click.option("--db", default=None, help=DB_HELP)
@click.option("--address", default=None, help=ADDRESS_HELP)
@click.option("--wait", is_flag=True, help="Wait until the ledger shows the job ended.")
@click.option("--timeout", default=120.0, show_default=True, help="Seconds --wait waits.")
def stop(job_id: str, db: str | None, address: str | None, wait: bool, timeout: float) -> None:
    """Ask a running job to stop; its in-flight rollouts end as `cancelled`."""
    from rlsys.ledger.store import Ledger

    with _reader(db) as reader:
        job = reader.get_job(job_id)
        url = str(reader.engine.url.render_as_string(hide_password=False))
    from rlsys.ledger.liveness import effective_status

    status = effective_status(job)
    if status == "orphaned":
        raise UserError(
            f"job {job_id} is orphaned (its driver is gone): `rlsys jobs reap {job_id}`"
        )
    if status != "running":
        raise UserError(f"job {job_id} is {status}, not running")
    address = cluster_address(address)
    by_ray = bool(address) and _on_cluster(address, _ray_jobs().stop_submitted, job_id)
    if not by_ray:
        writer = Ledger.open(url, create=False)
        try:
            writer.set_job_status(job_id, "stopping")
        finally:
            writer.close()
    click.echo(f"stop requested for {job_id}" + (f" (Ray job on {address})" if by_ray else ""))
    if wait:
        click.echo(f"{job_id} {_wait_until_ended(db, job_id, timeout)}")


def _wait_until_ended(db: str | None, job_id: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while True:
        from rlsys.ledger.liveness import effective_status

        with _reader(db) as reader:
            state = effective_status(reader.get_job(job_id))
        if state not in LIVE:
            return state
        if time.monotonic() > deadline:
            raise click.ClickException(f"job {job_id} is still {state} after {timeout:.0f} s")
        time.sleep(1.0)


@jobs.command()
@click.argument("job_id")
@click.option("--db", default=None, help=DB_HELP)
@click.option("--json", "as_json", is_flag=True)
def reap(job_id: str, db: str | None, as_json: bool) -> None:
    """End an orphaned job (its driver stopped beating): its live rollouts end
    `failed_driver_lost` and the job `failed`. `rlsys run CONFIG --resume JOB` continues it."""
    from rlsys.cli.render import print_json
    from rlsys.ledger.reconcile import reap_job

    with _reader(db) as writer:  # an unknown job, or one not orphaned: exit 2, saying why
        ended = reap_job(writer, job_id)
        reason = writer.get_job(job_id)["end_reason"]
    if as_json:
        print_json(
            {"job_id": job_id, "status": "failed", "rollouts_ended": ended, "reason": reason}
        )
        return
    click.echo(f"{job_id} failed ({reason}): {ended} live rollouts ended failed_driver_lost")


@jobs.command()
@click.argument("job_id")
@click.option("--address", default=None, help=ADDRESS_HELP)
@click.option("--follow", is_flag=True, help="Keep printing the output until the job ends.")
def logs(job_id: str, address: str | None, follow: bool) -> None:
    """The output of a submitted job's driver (its progress lines and summary)."""
    address = require_cluster_address(address)
    ray_jobs = _ray_jobs()
    if follow:
        if _on_cluster(address, ray_jobs.submitted_status, job_id) is None:
            raise UserError(f"the cluster at {address} has no job {job_id}")
        _on_cluster(address, ray_jobs.follow_logs, job_id, lambda s: click.echo(s, nl=False))
        return
    text = _on_cluster(address, ray_jobs.job_logs, job_id)
    if text is None:
        raise UserError(f"the cluster at {address} has no job {job_id}")
    click.echo(text, nl=False)
