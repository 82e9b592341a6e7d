"""Where a rollout reports what happened, turn by turn: the `EventSink` protocol.

The scaffold emits one event per generation turn, tool call, penalty, compaction, verdict
and failure. The actor layer wires a sink to the ledger's append-only event record; tests
use `ListEventSink`.

Invariants:
- `kind` is one of `EventKind`; `turn` is the turn index the event belongs to (-1: none);
  `tokens` is the size in tokens of what the event is about (the turn's generated tokens,
  an observation, a compacted state); `data` is JSON-ready (str/int/float/bool/None,
  lists and dicts of those).
- Events of one rollout are emitted in the order they happened, from one thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

EventKind = Literal["turn", "tool_call", "penalty", "compaction", "verdict", "failure"]


class EventSink(Protocol):
    def emit(self, kind: EventKind, turn: int, tokens: int, data: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class Event:
    kind: EventKind
    turn: int
    tokens: int
    data: dict[str, Any] = field(default_factory=dict)


class ListEventSink:
    """Keeps every event in memory, in order."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def emit(self, kind: EventKind, turn: int, tokens: int, data: dict[str, Any]) -> None:
        self.events.append(Event(kind, turn, tokens, dict(data)))

    def of_kind(self, kind: EventKind) -> list[Event]:
        return [e for e in self.events if e.kind == kind]


class NullEventSink:
    """Drops every event (demonstration generation, benchmarks)."""

    def emit(self, kind: EventKind, turn: int, tokens: int, data: dict[str, Any]) -> None:
        return None
