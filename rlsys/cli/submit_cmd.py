"""`rlsys submit CONFIG [--address URL]`: run a job on a Ray cluster through the Jobs API.

Invariants: everything is checked before the cluster is contacted (exit 2, nothing
submitted): the config, the cluster address (`--address`, else `RAY_API_SERVER_ADDRESS`,
else `RAY_ADDRESS`), and where the job's ledger will be. The ledger URL is resolved here,
by the rule every command applies (`store.ledger_url`, else `RLSYS_LEDGER_URL`, else the
run root's SQLite file), and handed to the job, so the user's shell and the job read and
write the same ledger; a ledger that would be a file in the cluster's temporary working
directory (a relative SQLite path) is refused, since nothing outside the job could read it
and it is deleted with the job.
"""

from __future__ import annotations

import click

from rlsys.cli.cluster_address import ADDRESS_HELP, require_cluster_address
from rlsys.cli.errors import UserError
from rlsys.cli.run_cmd import SET_HELP


def cluster_ledger_url(store_ledger_url: str | None, run_root: str) -> str:
    """The ledger URL a submitted job gets; `UserError` when it would be lost with the job."""
    from rlsys.config.locations import relative_sqlite_path, resolve_ledger_url

    url = resolve_ledger_url(store_ledger_url, run_root=run_root)
    path = relative_sqlite_path(url)
    if path is not None:
        raise UserError(
            f"the job's ledger would be the SQLite file {path} inside the cluster's temporary "
            "working directory, unreadable from here and deleted with the job: set "
            "RLSYS_LEDGER_URL (or store.ledger_url) to a database both the cluster and this "
            "shell reach, e.g. postgresql://USER@HOST/DB"
        )
    return url


@click.command()
@click.argument("config", type=click.Path(dir_okay=False))
@click.option("--address", default=None, help=ADDRESS_HELP)
@click.option("--set", "sets", multiple=True, help=SET_HELP)
@click.option(
    "--wait/--no-wait", default=False, help="Print the job's output until it ends, then its id."
)
@click.option(
    "--python",
    "python",
    default="python",
    show_default=True,
    help="The cluster's Python (with rlsys's dependencies) that runs the driver.",
)
def submit(
    config: str, address: str | None, sets: tuple[str, ...], wait: bool, python: str
) -> None:
    """Submit a job to a Ray cluster; prints its id (for `rlsys jobs`, `monitor`, `ledger`)."""
    from rlsys.cli.job_config import load_job_config

    cfg = load_job_config(config, sets)  # a bad config never reaches the cluster
    address = require_cluster_address(address)
    ledger_url = cluster_ledger_url(cfg.store.ledger_url, cfg.store.run_root)
    from rlsys.cli.ray_auth import enable_token_auth_if_available

    enable_token_auth_if_available()
    from rlsys.actors.submit import submit_job
    from rlsys.ledger.db import redact

    try:
        job_id = submit_job(
            address,
            config,
            sets,
            ledger_url=ledger_url,
            follow=wait,
            echo=lambda chunk: click.echo(chunk, nl=False),
            python=python,
        )
    except ConnectionError as err:
        raise UserError(f"cannot reach the Ray Jobs API at {address}: {err}") from err
    click.echo(
        f"submitted {job_id} to {address}; ledger {redact(ledger_url)}\n"
        f"  watch: rlsys monitor --job {job_id} --follow   (rlsys jobs logs {job_id} --follow)\n"
        f"  stop:  rlsys jobs stop {job_id}",
        err=True,
    )
    click.echo(job_id)
