"""An `EventSink` that turns scaffold and admission events into ledger event records.

Events are buffered per rollout and written with the rollout's next transition batch, so
a turn-level record costs no extra transaction.
"""

from __future__ import annotations

from typing import Any

from rlsys.ledger.records import Event


class LedgerEventBuffer:
    def __init__(self, rollout_id: str, job_id: str) -> None:
        self.rollout_id, self.job_id = rollout_id, job_id
        self.events: list[Event] = []
        self.turn = -1

    def emit(self, kind: str, turn: int, tokens: int, data: dict[str, Any]) -> None:
        """The scaffold's `EventSink.emit`."""
        self.turn = max(self.turn, turn)
        self.events.append(
            Event(self.rollout_id, self.job_id, kind, turn=turn, tokens=tokens, data=data)
        )

    def admission(self, kind: str, data: dict[str, Any]) -> None:
        """The admission client's `on_event` (waits, retries, migrations)."""
        self.events.append(
            Event(self.rollout_id, self.job_id, kind, turn=max(self.turn, 0), data=data)
        )

    def drain(self) -> list[Event]:
        out, self.events = self.events, []
        return out
