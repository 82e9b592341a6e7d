"""Opening a ledger database: URL resolution, engine set-up, reachability.

Invariants:
- the URL comes from `--db`, else `RLSYS_LEDGER_URL`, else the run root's SQLite file
  (`rlsys.config.locations`, the one rule every command applies);
- opening for reading never creates a file or a table (`must_exist=True`), so a typo in a
  path is an error, not an empty ledger;
- SQLite runs in WAL mode with a busy timeout, and a write transaction takes the write lock
  up front (`BEGIN IMMEDIATE`), so read-check-write in one transaction is atomic across
  threads and processes. PostgreSQL gets the same guarantee from `SELECT ... FOR UPDATE`.
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, NoSuchModuleError

from rlsys.config.locations import resolve_ledger_url
from rlsys.ledger.errors import LedgerUnreachable, LedgerUrlError

WRITE_OPTION = "rlsys_write"

_DRIVERS = {
    "sqlite": "sqlite",
    "postgresql": "postgresql+psycopg",
    "postgres": "postgresql+psycopg",
}


def resolve_url(explicit: str | None = None) -> str:
    """A reader's ledger URL: explicit, else `RLSYS_LEDGER_URL`, else the run root's file."""
    return resolve_ledger_url(explicit)


def redact(url: str) -> str:
    """The URL with any password hidden, for messages."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return url


def parse_url(url: str) -> URL:
    """Parse and normalise a ledger URL; `LedgerUrlError` names what is wrong."""
    try:
        parsed = make_url(url)
    except ArgumentError as err:
        raise LedgerUrlError(
            f"malformed ledger URL {url!r}: expected sqlite:///PATH or postgresql://HOST/DB"
        ) from err
    backend = parsed.get_backend_name()
    if backend not in _DRIVERS:
        raise LedgerUrlError(
            f"unsupported ledger backend {backend!r} in {redact(url)}: use sqlite or postgresql"
        )
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername=_DRIVERS[backend])
    if backend == "sqlite" and parsed.database in (None, "", ":memory:"):
        raise LedgerUrlError(f"ledger URL {url!r} names no file: use sqlite:///PATH")
    return parsed


def create_ledger_engine(url: str, *, must_exist: bool) -> Engine:
    """An engine for `url`, checked to answer; raises a `LedgerUserError` otherwise."""
    parsed = parse_url(url)
    if parsed.get_backend_name() == "sqlite":
        engine = _sqlite_engine(parsed, must_exist=must_exist)
    else:
        engine = create_engine(
            parsed,
            pool_pre_ping=True,
            pool_size=4,
            max_overflow=8,
            connect_args={"connect_timeout": 5},
        )
    try:
        with engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except (DBAPIError, NoSuchModuleError) as err:
        engine.dispose()
        first_line = str(getattr(err, "orig", err)).strip().splitlines()[0:1]
        detail = first_line[0] if first_line else type(err).__name__
        raise LedgerUnreachable(f"cannot reach ledger {redact(url)}: {detail}") from err
    return engine


def _sqlite_engine(parsed: URL, *, must_exist: bool) -> Engine:
    path = Path(parsed.database or "")
    if not path.parent.exists() and not must_exist:
        path.parent.mkdir(parents=True, exist_ok=True)
    if must_exist and not path.exists():
        raise LedgerUnreachable(f"no ledger database at {path} (sqlite file does not exist)")
    if not path.parent.is_dir():
        raise LedgerUnreachable(f"cannot reach ledger {path}: {path.parent} is not a directory")
    engine = create_engine(parsed, connect_args={"timeout": 60})

    @event.listens_for(engine, "connect")
    def _configure(dbapi_conn, _record) -> None:  # type: ignore[no-untyped-def]
        # Let SQLAlchemy's "begin" event issue BEGIN itself (the pysqlite recipe).
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA busy_timeout=60000")
        cur.close()

    @event.listens_for(engine, "begin")
    def _begin(conn) -> None:  # type: ignore[no-untyped-def]
        immediate = conn.get_execution_options().get(WRITE_OPTION, False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

    return engine
