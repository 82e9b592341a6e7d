import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect

from rlsys.ledger import migrate
from rlsys.ledger.db import create_ledger_engine
from rlsys.ledger.models import Base

pytestmark = pytest.mark.services

TABLES = {"jobs", "rollouts", "rollout_transitions", "rollout_events", "owners", "trainer_steps"}


def test_upgrade_from_empty_matches_the_models(ledger_url):
    engine = create_ledger_engine(ledger_url, must_exist=False)
    assert migrate.current_revision(engine) is None
    migrate.upgrade(engine)
    assert TABLES <= set(inspect(engine).get_table_names())
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert diff == []
    engine.dispose()


def test_downgrade_upgrade_round_trip(ledger_url):
    engine = create_ledger_engine(ledger_url, must_exist=False)
    migrate.upgrade(engine)
    head = migrate.current_revision(engine)
    migrate.downgrade(engine, "base")
    assert not TABLES & set(inspect(engine).get_table_names())
    migrate.upgrade(engine)
    assert migrate.current_revision(engine) == head
    assert TABLES <= set(inspect(engine).get_table_names())
    engine.dispose()
