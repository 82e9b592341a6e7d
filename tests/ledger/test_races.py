"""1,000 races per backend: two writers try to end the same rollout; exactly one wins.

Threads share one process (and one engine each); processes each open their own engine.
Every rollout must end with exactly one terminal history row, and every loser must have
received a `TransitionConflict` (not a silent no-op, not a crash).
"""

import multiprocessing as mp
import threading

import pytest
import sqlalchemy as sa

from rlsys.ledger.errors import TransitionConflict
from rlsys.ledger.store import Ledger
from tests.ledger.helpers import advance, planned_job

pytestmark = pytest.mark.services

RACES = 1000
ENDINGS = ("trained", "failed_engine")


def _end_all(url: str, ids: list[str], ending: str, start, out) -> None:  # type: ignore[no-untyped-def]
    ledger = Ledger.open(url, create=False)
    wins = conflicts = 0
    start.wait()
    for rid in ids:
        try:
            ledger.transition(rid, ending, reason=f"writer {ending}")
            wins += 1
        except TransitionConflict:
            conflicts += 1
    ledger.close()
    out.put((ending, wins, conflicts))


def _prepared(ledger):
    _, ids = planned_job(ledger, RACES)
    advance(ledger, ids)
    return ids


def _assert_exactly_one_terminal(ledger, ids, results):
    wins = sum(r[1] for r in results)
    conflicts = sum(r[2] for r in results)
    assert wins == RACES and conflicts == RACES
    with ledger.engine.connect() as conn:
        per_rollout = conn.execute(
            sa.text(
                "SELECT rollout_id, count(*) FROM rollout_transitions WHERE is_terminal "
                "GROUP BY rollout_id"
            )
        ).all()
        states = dict(conn.execute(sa.text("SELECT id, state FROM rollouts")).all())
    assert len(per_rollout) == RACES and all(n == 1 for _, n in per_rollout)
    assert all(states[r] in ENDINGS for r in ids)


def test_thread_races_leave_exactly_one_terminal_state(ledger, ledger_url):
    import queue

    ids = _prepared(ledger)
    start, out = threading.Barrier(len(ENDINGS)), queue.Queue()
    threads = [
        threading.Thread(target=_end_all, args=(ledger_url, ids, e, start, out)) for e in ENDINGS
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    _assert_exactly_one_terminal(ledger, ids, [out.get_nowait() for _ in ENDINGS])


def test_process_races_leave_exactly_one_terminal_state(ledger, ledger_url):
    ids = _prepared(ledger)
    ctx = mp.get_context("spawn")
    start, out = ctx.Barrier(len(ENDINGS)), ctx.Queue()
    procs = [ctx.Process(target=_end_all, args=(ledger_url, ids, e, start, out)) for e in ENDINGS]
    for p in procs:
        p.start()
    results = [out.get(timeout=300) for _ in ENDINGS]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    _assert_exactly_one_terminal(ledger, ids, results)
