"""How much a job generated per trained sample, and where the rest went, read from ledgers.

For each `LEDGER_URL[#JOB]` (the job defaults to the ledger's newest), one row: how the job
ended, its trainer steps, every rollout it created (`expected`), how they ended (`trained`,
`filtered_zero_variance`, cancelled at the job's end, failed), the zero-variance share of
all rollouts, and rollouts created per trained sample. This is the ledger's count, not the
progress line's: cancelled and failed rollouts count as generated work too.

    .venv/bin/python benchmarks/job_generation.py sqlite:///runs/ledger.db [URL#JOB ...]
"""

from __future__ import annotations

import argparse
from typing import Any

from rlsys.ledger.queries import list_jobs, stats, trainer_steps
from rlsys.ledger.store import Ledger

COLUMNS = (
    "job",
    "end",
    "steps",
    "rollouts",
    "trained",
    "zero-var",
    "cancelled",
    "failed",
    "zero-var share",
    "rollouts per trained",
)


def job_row(url: str, job_id: str | None) -> dict[str, Any]:
    """One job's generation figures (the ledger's newest job when `job_id` is None)."""
    ledger = Ledger.open(url, create=False)
    try:
        job_id = job_id or list_jobs(ledger, limit=1)[0]["id"]
        s = stats(ledger, job_id)
        steps = len(trainer_steps(ledger, job_id)["steps"])
        job = ledger.get_job(job_id)
    finally:
        ledger.close()
    terminal = s["terminal"]
    trained, zero_var = terminal.get("trained", 0), terminal.get("filtered_zero_variance", 0)
    failed = sum(v for k, v in terminal.items() if k.startswith("failed_"))
    expected = s["expected"]
    return {
        "job": job_id[:12],
        "end": f"{job['status']}: {job.get('end_reason') or '-'}"[:64],
        "steps": steps,
        "rollouts": expected,
        "trained": trained,
        "zero-var": zero_var,
        "cancelled": terminal.get("cancelled", 0),
        "failed": failed,
        "zero-var share": f"{zero_var / expected:.1%}" if expected else "-",
        "rollouts per trained": f"{expected / trained:.2f}" if trained else "-",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ledgers", nargs="+", help="LEDGER_URL or LEDGER_URL#JOB")
    args = parser.parse_args()
    rows = []
    for spec in args.ledgers:
        url, _, job = spec.partition("#")
        rows.append(job_row(url, job or None))
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for row in rows:
        print("| " + " | ".join(str(row[c]) for c in COLUMNS) + " |")


if __name__ == "__main__":
    main()
