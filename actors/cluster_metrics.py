"""A job's state as cluster metrics, through Ray's metrics API (`ray.util.metrics`).

Every Ray node's metrics agent serves them on its Prometheus endpoint (`ray start
--metrics-export-port`, scraped by the Ray dashboard's Prometheus/Grafana set-up), with
Ray's `ray_` prefix and a `job_id` label:

- `ray_rlsys_rollouts_ended_total{state, class}`: rollouts that reached a terminal state
  (`rate(...[1m])` is rollouts per second by terminal state);
- `ray_rlsys_rollouts_in_flight`, `ray_rlsys_admission_queue_depth`;
- `ray_rlsys_staleness_mean`, `ray_rlsys_staleness_max`, `ray_rlsys_policy_version`,
  `ray_rlsys_trainer_step`, `ray_rlsys_drop_rate`, `ray_rlsys_samples_per_second`.

Recorded by the driver once per trainer step from the step's metrics and the ledger's
counts: the counter grows by what the ledger ended since the last record, starting from
the counts when the job (re)started, so a resumed job does not re-count its past.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ray.util.metrics import Counter, Gauge

from rlsys.types import TERMINAL_CLASS

# gauge name -> (where its value is in a trainer step's metrics, description)
STEP_GAUGES: dict[str, tuple[str, str]] = {
    "rlsys_admission_queue_depth": ("serving.queue_depth", "Requests waiting in admission."),
    "rlsys_staleness_mean": ("staleness.mean", "Mean staleness of the last step's samples."),
    "rlsys_staleness_max": ("staleness.max", "Max staleness of the last step's samples."),
    "rlsys_policy_version": ("policy_version", "Policy version the trainer last published."),
    "rlsys_trainer_step": ("step", "Optimiser steps taken."),
    "rlsys_drop_rate": ("drop_rate", "Dropped / expected rollouts so far."),
    "rlsys_samples_per_second": ("samples_per_s", "Samples trained per second."),
}
CLASS_OF = {state.value: cls.value for state, cls in TERMINAL_CLASS.items()}


def _at(metrics: Mapping[str, Any], dotted: str) -> Any:
    node: Any = metrics
    for key in dotted.split("."):
        node = node.get(key) if isinstance(node, Mapping) else None
    return node


class ClusterMetrics:
    def __init__(self, job_id: str, terminal_at_start: Mapping[str, int]) -> None:
        tags = {"job_id": job_id}
        self.ended = Counter(
            "rlsys_rollouts_ended",
            description="Rollouts that reached a terminal state, by state and class.",
            tag_keys=("job_id", "state", "class"),
        )
        self.ended.set_default_tags(tags)
        self.in_flight = Gauge(
            "rlsys_rollouts_in_flight",
            description="Rollouts planned and not yet in a terminal state.",
            tag_keys=("job_id",),
        )
        self.in_flight.set_default_tags(tags)
        self.gauges = {}
        for name, (_, description) in STEP_GAUGES.items():
            self.gauges[name] = Gauge(name, description=description, tag_keys=("job_id",))
            self.gauges[name].set_default_tags(tags)
        self.counted = dict(terminal_at_start)

    def record(self, step_metrics: Mapping[str, Any] | None, stats: Mapping[str, Any]) -> None:
        """One trainer step (or, with `step_metrics` None, the job's end)."""
        for state, count in stats["terminal"].items():
            new = count - self.counted.get(state, 0)
            if new > 0:
                self.ended.inc(new, tags={"state": state, "class": CLASS_OF[state]})
                self.counted[state] = count
        self.in_flight.set(stats["in_flight"])
        for name, (path, _) in STEP_GAUGES.items():
            value = _at(step_metrics or {}, path)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.gauges[name].set(value)
