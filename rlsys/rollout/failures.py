"""Typed ends of a rollout that did not finish normally.

A failure is never folded into a reward of 0: the rollout ends in the named dropped state
of docs/ARCHITECTURE.md, "The ledger" (`failed_engine`, `failed_sandbox`, `failed_timeout`,
`failed_reward`) with a reason the ledger keeps (exception text, stderr tail).

Deeper layers (tools, verifiers) raise `RolloutAbort`; the scaffold catches it and returns
the `RolloutFailure` it carries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

FailedState = Literal["failed_engine", "failed_sandbox", "failed_timeout", "failed_reward"]

REASON_CHARS = 2000  # the tail of stderr / exception text we keep


@dataclass(frozen=True)
class RolloutFailure:
    state: FailedState
    reason: str
    turn: int = -1  # the turn it happened in; -1: before the first turn or after the last


class RolloutAbort(Exception):
    """Raised inside a rollout to end it with `failure`."""

    def __init__(self, state: FailedState, reason: str) -> None:
        super().__init__(f"{state}: {reason}")
        self.state: FailedState = state
        self.reason = tail(reason)


def tail(text: str, limit: int = REASON_CHARS) -> str:
    return text if len(text) <= limit else "..." + text[-limit:]


def describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"
