"""Counting a finished job in its ledger: every trained rollout trained exactly once."""

from __future__ import annotations

import json
from typing import Any

import sqlalchemy as sa

from rlsys.actors.job import ledger_url_for
from rlsys.ledger.store import Ledger


def assert_trained_exactly_once(cfg: Any, summary: dict[str, Any], steps: int) -> None:
    """The job completed with `lost` 0 and nothing live; its steps are 1..`steps`, and the
    samples those steps report add up to the `trained` rows (none skipped or repeated)."""
    assert summary["status"] == "completed" and summary["lost"] == 0
    lg = Ledger.open(ledger_url_for(cfg), create=False)
    try:
        with lg.engine.connect() as conn:
            rows = conn.execute(
                sa.text("SELECT step, metrics FROM trainer_steps WHERE job_id = :j ORDER BY step"),
                {"j": summary["job_id"]},
            ).all()
            trained = conn.execute(
                sa.text("SELECT count(*) FROM rollouts WHERE job_id = :j AND state = 'trained'"),
                {"j": summary["job_id"]},
            ).scalar_one()
            live = conn.execute(
                sa.text(
                    "SELECT count(*) FROM rollouts WHERE job_id = :j AND state IN "
                    "('planned','admitted','running','scored','buffered')"
                ),
                {"j": summary["job_id"]},
            ).scalar_one()
    finally:
        lg.close()
    assert [s for s, _ in rows] == list(range(1, steps + 1))
    # Raw SQL: PostgreSQL hands JSON back decoded, SQLite as text.
    metrics = [json.loads(m) if isinstance(m, str) else m for _, m in rows]
    assert sum(m["num_samples"] for m in metrics) == trained > 0
    assert live == 0
