"""The `rlsys ledger` commands as a user runs them: a real subprocess, real databases."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.services

STATS_KEYS = {
    "job_id",
    "expected",
    "in_flight",
    "terminal",
    "consumed",
    "discarded",
    "dropped",
    "lost",
    "drop_rate",
}


def rlsys(
    *args: str, cwd: Path | None = None, env: dict | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rlsys.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, **(env or {})},
        timeout=120,
    )


def test_stats_json_on_fresh_postgres_prints_every_key_with_zeros(pg_database_url):
    res = rlsys("ledger", "stats", "--db", pg_database_url, "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert STATS_KEYS <= set(out)
    assert out["expected"] == out["lost"] == out["dropped"] == 0 and out["drop_rate"] == 0.0


@pytest.mark.parametrize(
    "url, message",
    [
        ("not a url", "malformed ledger URL"),
        ("mysql://root@localhost/x", "unsupported ledger backend 'mysql'"),
        ("postgresql://postgres@127.0.0.1:1/test", "cannot reach ledger"),
        ("sqlite:////nonexistent-dir/ledger.db", "no ledger database at"),
    ],
)
def test_bad_urls_are_one_line_errors_with_exit_2(url, message):
    res = rlsys("ledger", "stats", "--db", url, "--json")
    assert res.returncode == 2
    assert message in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert res.stdout == ""


def test_missing_sqlite_file_is_an_error_and_is_not_created(tmp_path):
    path = tmp_path / "typo.db"
    res = rlsys("ledger", "stats", "--db", f"sqlite:///{path}")
    assert res.returncode == 2 and "no ledger database" in res.stderr
    assert not path.exists()


def test_demo_then_reports_and_unknown_ids(tmp_path):
    url = f"sqlite:///{tmp_path / 'demo.db'}"
    demo = rlsys("ledger", "demo", "--db", url, "--groups", "8")
    assert demo.returncode == 0, demo.stderr
    stats = json.loads(rlsys("ledger", "stats", "--db", url, "--json").stdout)
    assert stats["expected"] > 64 and stats["lost"] == 0 and stats["dropped"] > 0
    assert stats["drop_rate"] == pytest.approx(stats["dropped"] / stats["expected"])
    for by in ("reason", "length", "turns"):
        res = rlsys("ledger", "drops", "--db", url, "--by", by, "--json")
        assert res.returncode == 0 and json.loads(res.stdout)["rows"]
    table = rlsys("ledger", "drops", "--db", url)
    assert "failed_worker_lost" in table.stdout
    import sqlite3

    rid = (
        sqlite3.connect(tmp_path / "demo.db")
        .execute("SELECT id FROM rollouts WHERE retry_of IS NOT NULL LIMIT 1")
        .fetchone()[0]
    )
    shown = json.loads(rlsys("ledger", "show", rid, "--db", url, "--json").stdout)
    assert [e["kind"] for e in shown["events"]][0] == "retry_of"
    human = rlsys("ledger", "show", rid, "--db", url)
    assert human.returncode == 0 and "state history" in human.stdout
    for args in (("show", "r-nope"), ("stats", "--job", "j-nope"), ("drops", "--job", "j-nope")):
        res = rlsys("ledger", *args, "--db", url)
        assert res.returncode == 2 and res.stderr.startswith("error: unknown")


def test_url_from_environment_and_run_root(tmp_path):
    url = f"sqlite:///{tmp_path / 'env.db'}"
    assert rlsys("ledger", "demo", "--groups", "2", env={"RLSYS_LEDGER_URL": url}).returncode == 0
    res = rlsys("ledger", "stats", "--json", env={"RLSYS_LEDGER_URL": url})
    assert json.loads(res.stdout)["expected"] >= 16
    assert rlsys("ledger", "demo", "--groups", "2", cwd=tmp_path).returncode == 0
    assert (tmp_path / "runs" / "ledger.db").exists()


def test_help_imports_no_heavy_module():
    code = (
        "import sys; from rlsys.cli.main import cli; "
        "heavy = {'torch', 'ray', 'sqlalchemy', 'redis', 'rich', 'pydantic'} & set(sys.modules); "
        "print(sorted(heavy))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.stdout.strip() == "[]", res.stderr
