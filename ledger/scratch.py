"""A throw-away PostgreSQL database for benchmarks and tests: created, yielded, dropped.

Kept in the ledger layer so callers outside it never import SQLAlchemy themselves.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import sqlalchemy as sa


@contextmanager
def scratch_postgres_database(admin_url: str, prefix: str = "rlsys_scratch") -> Iterator[str]:
    """Create an empty database next to `admin_url`'s, yield its URL, drop it afterwards."""
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT", pool_pre_ping=True)
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    try:
        yield sa.make_url(admin_url).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
