"""Where a job's ledger is: one rule for every command that runs, submits or reads a job.

The ledger URL is the explicit one (`--db`, or the config's `store.ledger_url`), else
`RLSYS_LEDGER_URL`, else the SQLite file `ledger.db` in the run root. The run root is the
config's `store.run_root` for a job, and for a reader `RLSYS_RUN_ROOT`, else `./runs`
(a config that does not set `store.run_root` gets the same default).

Pure string logic (no SQLAlchemy), so the CLI can apply the rule before it imports the
ledger layer, and `rlsys submit` can check where a job's ledger would live.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

LEDGER_URL_ENV = "RLSYS_LEDGER_URL"
RUN_ROOT_ENV = "RLSYS_RUN_ROOT"
DEFAULT_RUN_ROOT = "runs"

# sqlite:///relative/path and sqlite:////absolute/path, with or without a driver suffix.
_SQLITE_FILE = re.compile(r"^sqlite(\+\w+)?:///(?P<path>.*)$")


def default_run_root() -> str:
    """The run root when nothing else names one: `RLSYS_RUN_ROOT`, else ./runs."""
    return os.environ.get(RUN_ROOT_ENV) or DEFAULT_RUN_ROOT


def resolve_ledger_url(explicit: str | None = None, run_root: str | Path | None = None) -> str:
    """The ledger URL by precedence: explicit, `RLSYS_LEDGER_URL`, the run root's SQLite file."""
    if explicit:
        return explicit
    if os.environ.get(LEDGER_URL_ENV):
        return os.environ[LEDGER_URL_ENV]
    root = Path(run_root if run_root is not None else default_run_root())
    return f"sqlite:///{root / 'ledger.db'}"


def relative_sqlite_path(url: str) -> str | None:
    """The path of a SQLite ledger named relative to the working directory, else None.

    Such a ledger lives wherever the job's process starts; for a job submitted to a
    cluster that is Ray's temporary copy of the working directory, gone after the job.
    """
    match = _SQLITE_FILE.match(url)
    if match is None or match["path"].startswith("/") or match["path"] in ("", ":memory:"):
        return None
    return match["path"]
