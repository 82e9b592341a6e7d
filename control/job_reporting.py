"""What a running job reports outward: experiment trackers and cluster metrics.

The driver calls `step` once per trainer step (through the controller's step callback)
and `end` once when the job is over, whatever the end; both read the ledger's counts of
the job. Invariant: reporting never fails the job: an error here is printed as an event
and the run goes on (trackers isolate their own failures, see `TrackerSet`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from rlsys.config.job import JobConfig
from rlsys.ledger.db import redact
from rlsys.ledger.queries import stats
from rlsys.ledger.store import Ledger
from rlsys.tracking.base import RunInfo
from rlsys.tracking.tracker_set import TrackerSet

StepCallback = Callable[[dict[str, Any]], None]


class MetricsRecorder(Protocol):
    """Where the job's state goes as cluster metrics (Ray's: `rlsys.actors.cluster_metrics`)."""

    def record(self, step_metrics: Mapping[str, Any] | None, stats: Mapping[str, Any]) -> None:
        """One trainer step (or, with `step_metrics` None, the job's end)."""
        ...


# (job id, the ledger's terminal counts when the job (re)started) -> a recorder
MetricsFactory = Callable[[str, Mapping[str, int]], MetricsRecorder]


class JobReporting:
    def __init__(
        self,
        job_id: str,
        ledger: Ledger,
        trackers: TrackerSet,
        metrics: MetricsRecorder,
        on_event: Callable[[str], None],
    ) -> None:
        self.job_id, self.ledger, self.on_event = job_id, ledger, on_event
        self.trackers, self.metrics = trackers, metrics

    @classmethod
    def open(
        cls,
        cfg: JobConfig,
        job_id: str,
        ledger: Ledger,
        run_dir: Path,
        on_event: Callable[[str], None],
        cluster_metrics: MetricsFactory,
    ) -> JobReporting:
        """Open every configured tracker (raises on a bad one) and the cluster metrics."""
        config = _without_passwords(ledger.get_job(job_id)["config"])
        info = RunInfo(job_id=job_id, name=cfg.name, config=config, run_dir=run_dir)
        trackers = TrackerSet.open(cfg.tracking, info, on_event)
        metrics = cluster_metrics(job_id, stats(ledger, job_id)["terminal"])
        return cls(job_id, ledger, trackers, metrics, on_event)

    def wrap(self, on_step: StepCallback | None) -> StepCallback:
        """The controller's step callback: report, then what the caller wanted."""

        def step(metrics: dict[str, Any]) -> None:
            self.step(metrics)
            if on_step is not None:
                on_step(metrics)

        return step

    def step(self, metrics: dict[str, Any]) -> None:
        self.trackers.log_step(metrics)
        try:
            self.metrics.record(metrics, stats(self.ledger, self.job_id))
        except Exception as err:  # noqa: BLE001 - see the module docstring
            self.on_event(f"cluster metrics not recorded at step {metrics.get('step')}: {err}")

    def end(self) -> None:
        """The job is over: final metrics, and every tracker closed with the final stats."""
        final: dict[str, Any] = {"job_id": self.job_id, "job_status": "failed"}
        try:
            final = stats(self.ledger, self.job_id)
            self.metrics.record(None, final)
        except Exception as err:  # noqa: BLE001 - see the module docstring
            self.on_event(f"final stats not reported: {err}")
        self.trackers.finish(final)


def _without_passwords(config: dict[str, Any]) -> dict[str, Any]:
    """The stored config as trackers may see it: store URLs with their passwords hidden."""
    store = dict(config.get("store", {}))
    for key in ("ledger_url", "stream_url"):
        if store.get(key):
            store[key] = redact(store[key])
    return {**config, "store": store}
