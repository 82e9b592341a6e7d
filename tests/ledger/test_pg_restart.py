"""PostgreSQL restarted in the middle of a stream of transitions loses and duplicates nothing.

A writer thread streams batched transitions and events while the real server is restarted
(fast shutdown: connections are cut, in-flight transactions roll back). The writer retries
with backoff; afterwards every rollout has exactly its history, in order, once.
"""

import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from rlsys.ledger.records import Event, Transition
from rlsys.ledger.retry import RetryPolicy
from rlsys.ledger.store import Ledger
from rlsys.types import RolloutState as S
from tests.conftest import PG_HOST, PG_PORT, service_answers
from tests.ledger.helpers import planned_job

pytestmark = pytest.mark.services

STEPS = (S.ADMITTED, S.RUNNING, S.SCORED, S.BUFFERED, S.TRAINED)
N_ROLLOUTS, BATCH = 400, 20


def _pg_ctl(action: str) -> None:
    version = sorted(p.name for p in Path("/etc/postgresql").iterdir())[-1]
    subprocess.run(
        ["pg_ctlcluster", "--skip-systemctl-redirect", version, "main", action, "-m", "fast"]
        if action != "start"
        else ["pg_ctlcluster", "--skip-systemctl-redirect", version, "main", "start"],
        check=True,
        timeout=120,
        capture_output=True,
    )


@pytest.fixture
def restartable_pg():
    if not (shutil.which("pg_ctlcluster") and Path("/etc/postgresql").is_dir()):
        pytest.skip("this machine's PostgreSQL is not managed by pg_ctlcluster")
    yield
    if not service_answers(PG_HOST, PG_PORT):
        _pg_ctl("start")


def test_restart_mid_stream_loses_and_duplicates_nothing(pg_database_url, restartable_pg, caplog):
    ledger = Ledger(Ledger.open(pg_database_url).engine, retry=RetryPolicy(deadline_s=90))
    job, ids = planned_job(ledger, N_ROLLOUTS)
    batches = []
    for step in STEPS:
        for i in range(0, N_ROLLOUTS, BATCH):
            chunk = ids[i : i + BATCH]
            batches.append(
                (
                    [Transition(r, step) for r in chunk],
                    [Event(r, job, "turn", data={"step": step.value}) for r in chunk],
                )
            )
    progress, errors = [], []

    def writer() -> None:
        try:
            for ts, es in batches:
                ledger.apply(ts, es)
                progress.append(1)
                time.sleep(0.01)
        except Exception as err:  # surfaced by the assertion below
            errors.append(err)

    thread = threading.Thread(target=writer)
    thread.start()
    while len(progress) < len(batches) // 4:
        time.sleep(0.01)
    restarted_at = len(progress)
    _pg_ctl("restart")
    thread.join(timeout=180)
    assert not errors, errors
    assert restarted_at < len(batches), "the restart happened after the stream had finished"
    assert "ledger write failed" in caplog.text, "the writer never saw the restart"
    with ledger.engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT rollout_id, seq, to_state FROM rollout_transitions ORDER BY rollout_id, seq"
            )
        ).all()
        n_events = conn.execute(sa.text("SELECT count(*) FROM rollout_events")).scalar()
        states = set(conn.execute(sa.text("SELECT DISTINCT state FROM rollouts")).scalars())
    per: dict[str, list[tuple[int, str]]] = {}
    for rid, seq, to in rows:
        per.setdefault(rid, []).append((seq, to))
    expected = [(0, "planned")] + [(k + 1, s.value) for k, s in enumerate(STEPS)]
    assert len(per) == N_ROLLOUTS and all(h == expected for h in per.values())
    assert n_events == N_ROLLOUTS * len(STEPS)
    assert states == {"trained"}
    ledger.close()
