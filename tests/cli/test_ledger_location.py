"""Where the ledger is: one rule for every command (docs/ARCHITECTURE.md, "The ledger")."""

import pytest

from rlsys.config.job import JobConfig
from rlsys.config.locations import relative_sqlite_path, resolve_ledger_url

pytestmark = pytest.mark.unit


def test_the_ledger_url_is_explicit_then_the_environment_then_the_run_roots_file(monkeypatch):
    monkeypatch.delenv("RLSYS_LEDGER_URL", raising=False)
    monkeypatch.delenv("RLSYS_RUN_ROOT", raising=False)
    assert resolve_ledger_url(None) == "sqlite:///runs/ledger.db"
    assert resolve_ledger_url(None, run_root="/data/rl") == "sqlite:////data/rl/ledger.db"
    monkeypatch.setenv("RLSYS_RUN_ROOT", "/srv/runs")
    assert resolve_ledger_url(None) == "sqlite:////srv/runs/ledger.db"
    monkeypatch.setenv("RLSYS_LEDGER_URL", "postgresql://u@db/rl")
    assert resolve_ledger_url(None, run_root="/data/rl") == "postgresql://u@db/rl"
    assert resolve_ledger_url("sqlite:////x.db") == "sqlite:////x.db"


def test_a_config_without_a_run_root_takes_the_readers_default(monkeypatch):
    monkeypatch.setenv("RLSYS_RUN_ROOT", "/srv/runs")
    assert JobConfig().store.run_root == "/srv/runs"
    monkeypatch.delenv("RLSYS_RUN_ROOT")
    assert JobConfig().store.run_root == "runs"


@pytest.mark.parametrize(
    "url, relative",
    [
        ("sqlite:///runs/ledger.db", "runs/ledger.db"),
        ("sqlite+pysqlite:///ledger.db", "ledger.db"),
        ("sqlite:////shared/ledger.db", None),
        ("postgresql://u@db/rl", None),
    ],
)
def test_only_a_relative_sqlite_file_lives_in_the_working_directory(url, relative):
    assert relative_sqlite_path(url) == relative
