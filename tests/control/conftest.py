"""Fixtures for the controller core: a real SQLite ledger, a real SQLite stream, a job
config. No Ray: the units under test take these directly."""

from __future__ import annotations

from pathlib import Path

import pytest

from rlsys.config.job import JobConfig
from rlsys.ledger.store import Ledger
from rlsys.ledger.stream import RolloutStream, SqliteStreamConfig, open_stream


def job_config(**rollout: object) -> JobConfig:
    return JobConfig.model_validate(
        {
            "rollout": {"group_size": 2, "groups_in_flight": 4, **rollout},
            "trainer": {"steps": 10, "groups_per_step": 2},
            "algo": {"max_staleness": 1},
        }
    )


@pytest.fixture
def ledger(tmp_path: Path):  # type: ignore[no-untyped-def]
    lg = Ledger.open(f"sqlite:///{tmp_path / 'ledger.db'}")
    yield lg
    lg.close()


@pytest.fixture
def job(ledger: Ledger) -> str:
    return ledger.create_job("t", {})


@pytest.fixture
def stream(tmp_path: Path):  # type: ignore[no-untyped-def]
    s: RolloutStream = open_stream(SqliteStreamConfig(path=str(tmp_path / "stream.db")))
    yield s
    s.close()
