"""Plain records a ledger writer hands over: planned rollouts, transitions, events.

Every record carries a client-generated id. A writer that retries a batch after a lost
connection re-sends the same ids, and the ledger skips what it already committed, so a
retry neither loses nor duplicates a transition or an event.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from rlsys.types import RolloutState

# Columns of `rollouts` a transition may set along with the state.
UPDATABLE_COLUMNS: tuple[str, ...] = (
    "owner",
    "policy_version_first",
    "policy_version_last",
    "trained_version",
    "prompt_tokens",
    "completion_tokens",
    "turns",
    "reward",
)


def new_id(prefix: str) -> str:
    """A globally unique id with a readable prefix (`r-` rollout, `j-` job, ...)."""
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class PlannedRollout:
    """One expected rollout, written as `planned` before anything is dispatched."""

    group_id: str
    task_id: str
    id: str = field(default_factory=lambda: new_id("r"))
    session_id: str = field(default_factory=lambda: new_id("s"))
    attempt: int = 0
    retry_of: str | None = None


@dataclass(frozen=True)
class Transition:
    """Move one rollout to `to_state`, optionally setting columns of its row.

    `expected_from`, when given, must equal the rollout's current state, so a writer can
    make its step conditional on what it believes the state to be.
    """

    rollout_id: str
    to_state: RolloutState
    reason: str | None = None
    expected_from: RolloutState | None = None
    updates: dict[str, Any] | None = None
    id: str = field(default_factory=lambda: new_id("t"))
    at: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        object.__setattr__(self, "to_state", RolloutState(self.to_state))
        if self.expected_from is not None:
            object.__setattr__(self, "expected_from", RolloutState(self.expected_from))
        unknown = set(self.updates or {}) - set(UPDATABLE_COLUMNS)
        if unknown:
            raise ValueError(f"transition updates unknown rollout columns: {sorted(unknown)}")


@dataclass(frozen=True)
class Event:
    """One entry of a rollout's append-only turn-level record.

    Kinds in use: turn, tool_call, penalty, admission_wait, admission_retry, migration,
    compaction, retry_of, retried_as, failure.
    """

    rollout_id: str
    job_id: str
    kind: str
    turn: int | None = None
    tokens: int | None = None
    data: dict[str, Any] | None = None
    id: str = field(default_factory=lambda: new_id("e"))
    at: float = field(default_factory=time.time)
