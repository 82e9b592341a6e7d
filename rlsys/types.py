"""Shared vocabulary of rlsys: rollout lifecycle states and their terminal classes.

Imports only the standard library, so the CLI, the ledger and the actors agree on names
without pulling in torch or ray.

Invariants (docs/ARCHITECTURE.md, "The ledger"):
- every terminal state belongs to exactly one class: consumed, discarded or dropped;
- no transition leaves a terminal state;
- `trained` is reachable only from `buffered` (a sample reaches an optimiser step only
  after it was handed to the trainer).
"""

from __future__ import annotations

from enum import StrEnum


class RolloutState(StrEnum):
    """Every state a rollout row can be in."""

    PLANNED = "planned"
    ADMITTED = "admitted"
    RUNNING = "running"
    SCORED = "scored"
    BUFFERED = "buffered"
    TRAINED = "trained"
    FILTERED_ZERO_VARIANCE = "filtered_zero_variance"
    FILTERED_STALE = "filtered_stale"
    FAILED_SANDBOX = "failed_sandbox"
    FAILED_ENGINE = "failed_engine"
    FAILED_TIMEOUT = "failed_timeout"
    FAILED_WORKER_LOST = "failed_worker_lost"
    FAILED_REWARD = "failed_reward"
    FAILED_STREAM = "failed_stream"  # the rollout stream stayed unreachable past the retry window
    FAILED_DRIVER_LOST = "failed_driver_lost"  # the job's driver died; reaped by `jobs reap`
    CANCELLED = "cancelled"


class TerminalClass(StrEnum):
    """The three classes every report groups terminal states into."""

    CONSUMED = "consumed"
    DISCARDED = "discarded"
    DROPPED = "dropped"


S = RolloutState

TERMINAL_CLASS: dict[RolloutState, TerminalClass] = {
    S.TRAINED: TerminalClass.CONSUMED,
    S.FILTERED_ZERO_VARIANCE: TerminalClass.DISCARDED,
    S.FILTERED_STALE: TerminalClass.DISCARDED,
    S.FAILED_SANDBOX: TerminalClass.DROPPED,
    S.FAILED_ENGINE: TerminalClass.DROPPED,
    S.FAILED_TIMEOUT: TerminalClass.DROPPED,
    S.FAILED_WORKER_LOST: TerminalClass.DROPPED,
    S.FAILED_REWARD: TerminalClass.DROPPED,
    S.FAILED_STREAM: TerminalClass.DROPPED,
    S.FAILED_DRIVER_LOST: TerminalClass.DROPPED,
    S.CANCELLED: TerminalClass.DROPPED,
}

TERMINAL_STATES: frozenset[RolloutState] = frozenset(TERMINAL_CLASS)
NON_TERMINAL_STATES: frozenset[RolloutState] = frozenset(S) - TERMINAL_STATES
DROPPED_STATES = frozenset(s for s, c in TERMINAL_CLASS.items() if c is TerminalClass.DROPPED)
DISCARDED_STATES = frozenset(s for s, c in TERMINAL_CLASS.items() if c is TerminalClass.DISCARDED)

# Failures and cancellation can end a rollout from any live state: a worker can die, or a
# job can be stopped, at any point of the chain.
_ANY_LIVE_END = DROPPED_STATES

ALLOWED_TRANSITIONS: dict[RolloutState, frozenset[RolloutState]] = {
    S.PLANNED: frozenset({S.ADMITTED}) | _ANY_LIVE_END,
    S.ADMITTED: frozenset({S.RUNNING}) | _ANY_LIVE_END,
    S.RUNNING: frozenset({S.SCORED}) | _ANY_LIVE_END,
    # A group can be filtered (zero variance) as soon as all its members are scored.
    S.SCORED: frozenset({S.BUFFERED}) | DISCARDED_STATES | _ANY_LIVE_END,
    S.BUFFERED: frozenset({S.TRAINED}) | DISCARDED_STATES | _ANY_LIVE_END,
    **{state: frozenset() for state in TERMINAL_STATES},
}


def is_terminal(state: str) -> bool:
    """True when `state` names a terminal state."""
    return RolloutState(state) in TERMINAL_STATES


def terminal_class(state: str) -> TerminalClass:
    """The class of a terminal state; KeyError for a live one."""
    return TERMINAL_CLASS[RolloutState(state)]


def transition_allowed(from_state: str, to_state: str) -> bool:
    """Whether the state machine permits `from_state -> to_state`."""
    return RolloutState(to_state) in ALLOWED_TRANSITIONS[RolloutState(from_state)]
