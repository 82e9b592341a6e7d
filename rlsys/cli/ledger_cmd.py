"""`rlsys ledger stats|drops|show|demo`: reports over a lifecycle ledger.

Readers open the ledger with `create=False`: a report never creates a file or a table, and
a wrong URL or id is a one-line error with exit code 2.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import click

from rlsys.cli.errors import UserError

DB_HELP = "Ledger URL (else $RLSYS_LEDGER_URL, else the run root's SQLite file)."


@contextmanager
def _reader(db: str | None) -> Iterator[Any]:
    """Open a ledger for reading; ledger user errors become `UserError`."""
    from rlsys.ledger.errors import LedgerUserError
    from rlsys.ledger.store import Ledger

    try:
        ledger = Ledger.open(db, create=False)
    except LedgerUserError as err:
        raise UserError(str(err)) from err
    try:
        yield ledger
    except LedgerUserError as err:
        raise UserError(str(err)) from err
    finally:
        ledger.close()


def _report(db: str | None, fn: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
    with _reader(db) as ledger:
        return fn(ledger)


@click.group()
def ledger() -> None:
    """Query the lifecycle ledger: where every expected rollout ended, and why."""


@ledger.command()
@click.option("--db", default=None, help=DB_HELP)
@click.option("--job", "job_id", default=None, help="Job id (default: the latest job).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def stats(db: str | None, job_id: str | None, as_json: bool) -> None:
    """Expected, in flight, terminal states by class, lost, and the drop rate."""
    from rlsys.cli.render import print_json, print_table
    from rlsys.ledger.queries import stats as ledger_stats

    out = _report(db, lambda lg: ledger_stats(lg, job_id))
    if as_json:
        print_json(out)
        return
    head = [
        (k, out[k])
        for k in (
            "job_id",
            "job_status",
            "end_reason",
            "expected",
            "in_flight",
            "consumed",
            "discarded",
            "dropped",
            "lost",
            "drop_rate",
            "retries",
        )
    ]
    print_table("ledger stats", ["key", "value"], head)
    print_table("terminal states", ["state", "count"], [(s, n) for s, n in out["terminal"].items()])


@ledger.command()
@click.option("--db", default=None, help=DB_HELP)
@click.option("--job", "job_id", default=None, help="Job id (default: the latest job).")
@click.option(
    "--by",
    type=click.Choice(["reason", "length", "turns"]),
    default="reason",
    show_default=True,
    help="How to slice the dropped rollouts.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def drops(db: str | None, job_id: str | None, by: str, as_json: bool) -> None:
    """Dropped rollouts by reason, completion length bucket or number of turns."""
    from rlsys.cli.render import print_json, print_table
    from rlsys.ledger.queries import drops as ledger_drops

    out = _report(db, lambda lg: ledger_drops(lg, job_id, by))  # type: ignore[arg-type]
    if as_json:
        print_json(out)
        return
    title = f"drops by {by} (job {out['job_id']}, drop rate {out['drop_rate']:.4f})"
    if by == "reason":
        rows = [
            (r["reason"], r["dropped"], r["share_of_expected"], r["example"]) for r in out["rows"]
        ]
        print_table(title, ["reason", "dropped", "of expected", "example"], rows)
    else:
        rows = [(r["bucket"], r["expected"], r["dropped"], r["drop_rate"]) for r in out["rows"]]
        print_table(title, [by, "expected", "dropped", "drop rate"], rows)


@ledger.command()
@click.argument("rollout_id")
@click.option("--db", default=None, help=DB_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def show(rollout_id: str, db: str | None, as_json: bool) -> None:
    """One rollout: its row, state history and turn-level events."""
    from rlsys.cli.render import print_json, print_table
    from rlsys.ledger.queries import show as ledger_show

    out = _report(db, lambda lg: ledger_show(lg, rollout_id))
    if as_json:
        print_json(out)
        return
    print_table(f"rollout {rollout_id}", ["field", "value"], list(out["rollout"].items()))
    print_table(
        "state history",
        ["seq", "from", "to", "at", "reason"],
        [(h["seq"], h["from_state"], h["to_state"], h["at"], h["reason"]) for h in out["history"]],
    )
    print_table(
        "events",
        ["kind", "turn", "tokens", "data"],
        [(e["kind"], e["turn"], e["tokens"], e["data"]) for e in out["events"]],
    )
    if out["retried_as"]:
        click.echo(f"retried as: {', '.join(out['retried_as'])}")


@ledger.command()
@click.option("--db", default=None, help=DB_HELP)
@click.option("--groups", default=32, show_default=True, type=click.IntRange(1, 100_000))
@click.option("--group-size", default=8, show_default=True, type=click.IntRange(1, 1024))
@click.option("--seed", default=0, show_default=True, type=int)
def demo(db: str | None, groups: int, group_size: int, seed: int) -> None:
    """Simulate a job's worth of rollouts (with failures) into a ledger, then report it."""
    from rlsys.cli.render import print_table
    from rlsys.ledger.db import resolve_url
    from rlsys.ledger.demo import simulate_job
    from rlsys.ledger.errors import LedgerUserError
    from rlsys.ledger.queries import drops as ledger_drops
    from rlsys.ledger.queries import stats as ledger_stats
    from rlsys.ledger.store import Ledger

    url = resolve_url(db)
    try:
        lg = Ledger.open(url, create=True)
    except LedgerUserError as err:
        raise UserError(str(err)) from err
    try:
        job_id = simulate_job(lg, groups=groups, group_size=group_size, seed=seed)
        out, by_reason = ledger_stats(lg, job_id), ledger_drops(lg, job_id, "reason")
    finally:
        lg.close()
    print_table(
        "demo job",
        ["key", "value"],
        [
            (k, out[k])
            for k in ("job_id", "expected", "consumed", "discarded", "dropped", "lost", "drop_rate")
        ],
    )
    print_table(
        "drops by reason",
        ["reason", "dropped", "example"],
        [(r["reason"], r["dropped"], r["example"]) for r in by_reason["rows"]],
    )
    click.echo(f"ledger: {url}\nnext: rlsys ledger stats --db {url} --job {job_id}")
