"""Schema migrations, driven from code (no alembic.ini on the user's side).

`upgrade(engine)` brings any ledger (empty or older) to the newest schema; it is what
`Ledger.open(..., create=True)` runs. `downgrade` exists for the round-trip test and for
operators rolling back a release.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Engine

MIGRATIONS_DIR = Path(__file__).parent / "migrations"


def _config(connection) -> Config:  # type: ignore[no-untyped-def]
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.attributes["connection"] = connection
    return cfg


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Migrate the ledger schema up to `revision`."""
    with engine.begin() as conn:
        command.upgrade(_config(conn), revision)


def downgrade(engine: Engine, revision: str) -> None:
    """Migrate the ledger schema down to `revision` (`base` removes everything)."""
    with engine.begin() as conn:
        command.downgrade(_config(conn), revision)


def head_revision() -> str:
    """The newest schema revision this code knows."""
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(_config(None)).get_current_head()
    assert head is not None
    return head


def current_revision(engine: Engine) -> str | None:
    """The schema revision of this database, or None when it holds no ledger."""
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()
