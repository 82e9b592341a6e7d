"""`rlsys jobs list|status|stop`: jobs as the ledger knows them (and Ray, when submitted).

`stop` asks a running job to stop: the ledger row is set to `stopping`, the job's
controller sees it within a second, cancels its in-flight rollouts and ends the job as
`stopped`. With `--address`, the Ray job of a submitted run is stopped too.
"""

from __future__ import annotations

import click

from rlsys.cli.errors import UserError
from rlsys.cli.ledger_cmd import DB_HELP, _reader


@click.group()
def jobs() -> None:
    """List jobs, show one job's accounting, or stop a running job."""


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
        ["job", "name", "status", "rollouts"],
        [(r["id"], r["name"], r["status"], r["rollouts"]) for r in rows],
    )


@jobs.command()
@click.argument("job_id")
@click.option("--db", default=None, help=DB_HELP)
@click.option("--address", default=None, help="Ray dashboard address of a submitted job.")
@click.option("--json", "as_json", is_flag=True)
def status(job_id: str, db: str | None, address: str | None, as_json: bool) -> None:
    """A job's status and accounting (expected, consumed, dropped, lost, drop rate)."""
    from rlsys.cli.render import print_json, print_table
    from rlsys.ledger.queries import stats

    out: dict = {}
    if address:
        from rlsys.cli.ray_auth import enable_token_auth_if_available

        enable_token_auth_if_available()
        from rlsys.actors.submit import submitted_status

        out["ray_status"] = submitted_status(address, job_id)
    try:
        with _reader(db) as ledger:
            out.update(stats(ledger, job_id))
    except UserError:
        if not address:
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
@click.option("--address", default=None, help="Ray dashboard address of a submitted job.")
def stop(job_id: str, db: str | None, address: str | None) -> None:
    """Ask a running job to stop; its in-flight rollouts end as `cancelled`."""
    from rlsys.ledger.store import Ledger

    with _reader(db) as reader:
        job = reader.get_job(job_id)
        url = str(reader.engine.url.render_as_string(hide_password=False))
    if job["status"] != "running":
        raise UserError(f"job {job_id} is {job['status']}, not running")
    writer = Ledger.open(url, create=False)
    try:
        writer.set_job_status(job_id, "stopping")
    finally:
        writer.close()
    if address:
        from rlsys.cli.ray_auth import enable_token_auth_if_available

        enable_token_auth_if_available()
        from rlsys.actors.submit import stop_submitted

        stop_submitted(address, job_id)
    click.echo(f"stop requested for {job_id}")
