"""Is a job's driver alive? The heartbeat on the job row, read one way by every report.

A driver renews `jobs.heartbeat_at` while its job runs (`Ledger.job_heartbeat`). A job
whose status is live (`running`, `stopping`) and whose heartbeat is older than its
`store.driver_timeout_s` (from the config stored with the job; 60 s when absent) is
`orphaned`: its driver died without ending it (SIGKILL, a lost node). Reports count an
orphaned job's live rollouts as `lost`, never as in flight, until `reap_job` ends them
`failed_driver_lost` and the job `failed`. `orphaned` is derived, never stored: a driver
that comes back (a paused process) renews its heartbeat and the job reads `running` again.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from rlsys.ledger.errors import LedgerUserError
from rlsys.ledger.store import JOB_LIVE_STATUSES

DEFAULT_DRIVER_TIMEOUT_S = 60.0
JOB_ORPHANED = "orphaned"


class JobNotOrphaned(LedgerUserError):
    """`reap` was asked for a job whose driver is alive, or that already ended."""


class JobStillRunning(LedgerUserError):
    """A resume was asked for a job whose driver is alive."""


def driver_timeout_s(job: Mapping[str, Any]) -> float:
    """The job's `store.driver_timeout_s`, as its stored config says."""
    store = (job.get("config") or {}).get("store") or {}
    return float(store.get("driver_timeout_s", DEFAULT_DRIVER_TIMEOUT_S))


def heartbeat_age_s(job: Mapping[str, Any], now: float | None = None) -> float:
    """Seconds since the driver last renewed the job (since its creation if never)."""
    beat = job.get("heartbeat_at") or job["created_at"]
    return (time.time() if now is None else now) - float(beat)


def is_orphaned(job: Mapping[str, Any], now: float | None = None) -> bool:
    return job["status"] in JOB_LIVE_STATUSES and heartbeat_age_s(job, now) > driver_timeout_s(job)


def effective_status(job: Mapping[str, Any], now: float | None = None) -> str:
    """The status every report shows: the stored one, or `orphaned` for a live job whose
    driver stopped beating."""
    return JOB_ORPHANED if is_orphaned(job, now) else str(job["status"])
