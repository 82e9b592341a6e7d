"""Ledger write throughput for a realistic rollout lifecycle, batched, SQLite and PostgreSQL.

Each rollout goes plan -> admit -> run -> 10 turn events -> score -> buffer -> trained:
6 state transitions (the plan write included) and 10 events. Rollouts arrive in waves of
`--wave` rollouts; each stage of a wave is one batched transaction, as the controller's
writer flushes it. Reported: state transitions/s, all ledger rows/s, and p50/p99 commit
latency per batch.

    .venv/bin/python benchmarks/bench_ledger.py [--rollouts 20000] [--wave 500]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from rlsys.ledger.records import Event, PlannedRollout, Transition
from rlsys.ledger.scratch import scratch_postgres_database
from rlsys.ledger.store import Ledger
from rlsys.types import RolloutState as S

PG_ADMIN = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def run_lifecycle(ledger: Ledger, rollouts: int, wave: int) -> dict[str, float]:
    job = ledger.create_job("bench", {})
    latencies: list[float] = []

    def timed(fn, *args) -> None:  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        fn(*args)
        latencies.append(time.perf_counter() - t0)

    start = time.perf_counter()
    for w in range(0, rollouts, wave):
        planned = [PlannedRollout(f"g{(w + i) // 8}", "t") for i in range(min(wave, rollouts - w))]
        ids = [p.id for p in planned]
        timed(ledger.plan, job, planned)
        timed(
            ledger.apply,
            [
                t
                for r in ids
                for t in (
                    Transition(r, S.ADMITTED, updates={"owner": "w0"}),
                    Transition(r, S.RUNNING),
                )
            ],
        )
        timed(
            ledger.apply,
            (),
            [Event(r, job, "turn", turn=k, tokens=128) for r in ids for k in range(10)],
        )
        timed(
            ledger.apply,
            [
                t
                for r in ids
                for t in (
                    Transition(
                        r, S.SCORED, updates={"reward": 1.0, "turns": 10, "completion_tokens": 1280}
                    ),
                    Transition(r, S.BUFFERED),
                )
            ],
        )
        timed(ledger.apply, [Transition(r, S.TRAINED, updates={"trained_version": 1}) for r in ids])
    elapsed = time.perf_counter() - start
    transitions, events = rollouts * 6, rollouts * 10
    return {
        "transitions_per_s": transitions / elapsed,
        "rows_per_s": (transitions + events) / elapsed,
        "p50_ms": statistics.median(latencies) * 1e3,
        "p99_ms": statistics.quantiles(latencies, n=100)[98] * 1e3,
        "elapsed_s": elapsed,
    }


def sqlite_url(tmp: Path) -> str:
    return f"sqlite:///{tmp / 'bench.db'}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=20_000)
    parser.add_argument("--wave", type=int, nargs="+", default=[100, 500])
    args = parser.parse_args()
    rows = []
    for wave in args.wave:
        with tempfile.TemporaryDirectory() as tmp:
            lg = Ledger.open(sqlite_url(Path(tmp)))
            rows.append(("sqlite", wave, run_lifecycle(lg, args.rollouts, wave)))
            lg.close()
        with scratch_postgres_database(PG_ADMIN, "rlsys_bench") as url:
            lg = Ledger.open(url)
            rows.append(("postgresql", wave, run_lifecycle(lg, args.rollouts, wave)))
            lg.close()
    print(f"rollouts={args.rollouts}; per rollout: 6 transitions + 10 events")
    print(
        f"{'backend':<11} {'wave':>5} {'transitions/s':>14} {'rows/s':>10} {'p50 ms':>8} {'p99 ms':>8}"
    )
    for backend, wave, r in rows:
        print(
            f"{backend:<11} {wave:>5} {r['transitions_per_s']:>14,.0f} {r['rows_per_s']:>10,.0f} "
            f"{r['p50_ms']:>8.1f} {r['p99_ms']:>8.1f}"
        )


if __name__ == "__main__":
    main()
