"""Errors of the ledger.

`LedgerUserError` subclasses name a mistake in what the user gave (a URL, an id): the CLI
prints their one-line message and exits 2. `TransitionConflict` is what a writer gets when
another writer ended (or moved) the rollout first: the state machine said no.
"""

from __future__ import annotations


class LedgerError(Exception):
    """Base class of every ledger error."""


class LedgerUserError(LedgerError):
    """A user-facing problem with a one-line message (bad URL, unknown id, unreachable db)."""


class LedgerUrlError(LedgerUserError):
    """The ledger URL is malformed or names an unsupported backend."""


class LedgerUnreachable(LedgerUserError):
    """The database could not be reached or opened."""


class UnknownJob(LedgerUserError):
    """No job with that id in this ledger."""


class UnknownRollout(LedgerUserError):
    """No rollout with that id in this ledger."""


class TransitionConflict(LedgerError):
    """One or more transitions were refused: the rollout was not in a state that allows them.

    Raised before anything of the batch is committed.
    """

    def __init__(self, conflicts: list[str]) -> None:
        self.conflicts = conflicts
        more = f" (and {len(conflicts) - 1} more)" if len(conflicts) > 1 else ""
        super().__init__(f"transition conflict: {conflicts[0]}{more}")
