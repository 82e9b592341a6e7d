"""User-facing errors of the command line.

Invariant: a `UserError` is raised *before* anything is written, so the CLI can print its
one line and exit 2 knowing the ledger, the run root and the cluster are untouched.
"""

from __future__ import annotations


class UserError(Exception):
    """A mistake in the user's input (argument, config, URL, id): one line, exit code 2."""

    exit_code = 2
