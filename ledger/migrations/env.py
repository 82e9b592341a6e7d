"""Alembic environment: runs on the connection the caller hands over in `config.attributes`.

rlsys never reads alembic.ini: `rlsys.ledger.migrate` builds the config in code, so the
migrations travel inside the installed package.
"""

from __future__ import annotations

from alembic import context

from rlsys.ledger.models import Base

connection = context.config.attributes["connection"]
context.configure(
    connection=connection,
    target_metadata=Base.metadata,
    render_as_batch=connection.dialect.name == "sqlite",
)
with context.begin_transaction():
    context.run_migrations()
