"""Retrying a ledger write through transient database failures.

A write is one transaction. If the connection drops (PostgreSQL restarted, SQLite busy
beyond its timeout), the whole transaction is re-run after a backoff, told that it is a
retry, so it can skip what an earlier attempt may already have committed (its records
carry client ids). User errors and conflicts are never retried.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

from rlsys.ledger.db import WRITE_OPTION

T = TypeVar("T")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff: first delay, growth factor, cap, and the total time allowed."""

    first_delay_s: float = 0.05
    factor: float = 2.0
    max_delay_s: float = 2.0
    deadline_s: float = 120.0


def is_transient(err: BaseException) -> bool:
    """Connection-level failures that a re-run of the transaction can get past."""
    if isinstance(err, DBAPIError) and err.connection_invalidated:
        return True
    return isinstance(err, (OperationalError, InterfaceError))


def run_write(
    engine: Engine, work: Callable[[Connection, bool], T], policy: RetryPolicy | None = None
) -> T:
    """Run `work(conn, retrying)` in a write transaction, retrying transient failures."""
    policy = policy or RetryPolicy()
    delay, started, attempt = policy.first_delay_s, time.monotonic(), 0
    while True:
        try:
            with engine.connect() as conn:
                conn = conn.execution_options(**{WRITE_OPTION: True})
                with conn.begin():
                    return work(conn, attempt > 0)
        except Exception as err:
            if not is_transient(err) or time.monotonic() - started > policy.deadline_s:
                raise
            attempt += 1
            log.warning("ledger write failed (%s); retry %d in %.2fs", err, attempt, delay)
            time.sleep(delay)
            delay = min(delay * policy.factor, policy.max_delay_s)
