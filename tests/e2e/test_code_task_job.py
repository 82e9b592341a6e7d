"""Both tasks run through Ray actors against engine replicas with real bwrap sandboxes, and
their turns, tool calls, penalties and admission events are in the ledger (`ledger show`)."""

import json
import subprocess
import sys

import pytest
import sqlalchemy as sa

from rlsys.actors.job import ledger_url_for, run_job
from rlsys.ledger.store import Ledger

pytestmark = [pytest.mark.e2e, pytest.mark.ray]


def test_code_task_rollouts_are_recorded_turn_by_turn(tiny_job):
    cfg = tiny_job(
        1,
        "rollout.task={type: code, hidden_cases: 4}",
        "engine.max_context_tokens=1536",
        "engine.max_running=1",  # one slot per replica: requests must wait in place
        "engine.max_queue=2",
        "rollout.group_size=4",
        "rollout.groups_in_flight=2",
        "trainer.groups_per_step=1",
        "trainer.warm_start.steps=0",
    )
    summary = run_job(cfg, on_event=lambda s: None)
    assert summary["lost"] == 0 and summary["job_status"] == "completed"
    lg = Ledger.open(ledger_url_for(cfg), create=False)
    with lg.engine.connect() as conn:
        kinds = {k for (k,) in conn.execute(sa.text("SELECT DISTINCT kind FROM rollout_events"))}
        rid = conn.execute(
            sa.text(
                "SELECT id FROM rollouts WHERE task_id LIKE 'code/%' AND state IN "
                "('trained','filtered_zero_variance') LIMIT 1"
            )
        ).scalar()
    lg.close()
    assert {"turn", "tool_call" if "tool_call" in kinds else "penalty", "verdict"} <= kinds
    assert {"admission_wait", "admission_retry"} <= kinds
    shown = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlsys.cli",
            "ledger",
            "show",
            rid,
            "--db",
            ledger_url_for(cfg),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    events = [e["kind"] for e in json.loads(shown.stdout)["events"]]
    assert "turn" in events and "verdict" in events
