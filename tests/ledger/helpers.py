"""Small builders shared by the ledger tests."""

from __future__ import annotations

from rlsys.ledger.records import PlannedRollout, Transition
from rlsys.ledger.store import Ledger
from rlsys.types import RolloutState as S

TO_BUFFERED = (S.ADMITTED, S.RUNNING, S.SCORED, S.BUFFERED)


def planned_job(ledger: Ledger, n: int, group_size: int = 4) -> tuple[str, list[str]]:
    job = ledger.create_job("test", {"test": True})
    ids = ledger.plan(job, [PlannedRollout(f"g{i // group_size}", "t") for i in range(n)])
    return job, ids


def advance(ledger: Ledger, ids: list[str], states=TO_BUFFERED, owner: str | None = None) -> None:
    ts = []
    for rid in ids:
        for k, s in enumerate(states):
            ts.append(Transition(rid, s, updates={"owner": owner} if owner and k == 0 else None))
    ledger.apply(ts)
