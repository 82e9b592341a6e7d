import pytest

from rlsys.ledger.errors import UnknownJob, UnknownRollout
from rlsys.ledger.queries import drops, show, stats
from rlsys.ledger.records import Transition
from rlsys.ledger.store import Ledger
from rlsys.types import RolloutState as S
from tests.ledger.helpers import advance, planned_job

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


def test_stats_on_a_fresh_database_are_zeros_and_write_nothing(ledger_url):
    from sqlalchemy import inspect

    reader = Ledger.open(ledger_url, create=False) if "postgresql" in ledger_url else None
    if reader is None:  # an empty SQLite file is a fresh database too
        import pathlib

        pathlib.Path(ledger_url.removeprefix("sqlite:///")).touch()
        reader = Ledger.open(ledger_url, create=False)
    out = stats(reader)
    assert STATS_KEYS <= set(out)
    assert out["expected"] == 0 and out["drop_rate"] == 0.0 and out["job_id"] is None
    assert all(v == 0 for v in out["terminal"].values())
    assert inspect(reader.engine).get_table_names() == []
    reader.close()


def test_drop_rate_is_dropped_over_expected(ledger):
    job, ids = planned_job(ledger, 10)
    advance(ledger, ids[:6])
    ledger.apply([Transition(r, S.TRAINED) for r in ids[:4]])
    ledger.apply([Transition(r, S.FILTERED_STALE) for r in ids[4:6]])
    ledger.apply([Transition(r, S.FAILED_SANDBOX, reason="exit 137") for r in ids[6:9]])
    out = stats(ledger, job)
    assert (out["expected"], out["consumed"], out["discarded"], out["dropped"]) == (10, 4, 2, 3)
    assert out["in_flight"] == 1 and out["lost"] == 0
    assert out["drop_rate"] == pytest.approx(0.3)


def test_drops_by_reason_length_and_turns(ledger):
    job, ids = planned_job(ledger, 4)
    ledger.apply(
        [
            Transition(ids[0], S.ADMITTED),
            Transition(ids[0], S.RUNNING),
            Transition(
                ids[0],
                S.FAILED_TIMEOUT,
                reason="600 s",
                updates={"completion_tokens": 5000, "turns": 9},
            ),
        ]
    )
    ledger.apply([Transition(ids[1], S.FAILED_ENGINE, reason="oom")])
    by_reason = drops(ledger, job, "reason")
    assert {r["reason"]: r["dropped"] for r in by_reason["rows"]} == {
        "failed_timeout": 1,
        "failed_engine": 1,
    }
    by_len = {
        r["bucket"]: (r["expected"], r["dropped"]) for r in drops(ledger, job, "length")["rows"]
    }
    assert by_len == {"0-255": (3, 1), "4096-16383": (1, 1)}
    by_turns = {r["bucket"]: r["dropped"] for r in drops(ledger, job, "turns")["rows"]}
    assert by_turns == {"0-0": 1, "8-15": 1}


def test_show_and_unknown_ids(ledger):
    job, (rid,) = planned_job(ledger, 1)
    assert show(ledger, rid)["history"][0]["to_state"] == "planned"
    with pytest.raises(UnknownRollout):
        show(ledger, "r-missing")
    with pytest.raises(UnknownJob):
        stats(ledger, "j-missing")
