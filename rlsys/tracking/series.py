"""The per-step series of a job: what `rlsys monitor` shows and every tracker records.

One list, so the monitor's table, plot and event files and the trackers never disagree on
what a step reports. Keys are paths into a trainer step's metrics (as the ledger stores
them); a series a step lacks (an older job, `mismatch` where it is not measured) is left
out of that step, never recorded as zero.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

SERIES: tuple[tuple[str, str], ...] = (
    ("reward_mean", "reward"),
    ("staleness.mean", "staleness (mean)"),
    ("staleness.max", "staleness (max)"),
    ("logprob_drift.mean_abs", "log-prob drift (mean |d|)"),
    ("logprob_drift.max_abs", "log-prob drift (max |d|)"),
    ("mismatch.mean_abs", "train/inference mismatch (mean |d|)"),
    ("mismatch.max_abs", "train/inference mismatch (max |d|)"),
    ("mismatch.k3_kl", "train/inference mismatch (k3 KL)"),
    ("candidate_set.mean", "candidate set size (mean)"),
    ("candidate_set.p90", "candidate set size (p90)"),
    ("kl", "KL estimate (to the reference, else behaviour -> current, k3)"),
    ("entropy", "entropy"),
    ("num_samples", "samples"),
    ("drop_rate", "drop rate"),
    ("samples_per_s", "throughput (samples/s)"),
    ("serving.queue_depth", "admission queue depth"),
    ("serving.prefix_cache_hit_rate", "prefix-cache hit rate"),
)


def lookup(metrics: Mapping[str, Any], dotted: str) -> Any:
    """The value at `a.b.c` in nested mappings, or None where any part is missing."""
    node: Any = metrics
    for key in dotted.split("."):
        node = node.get(key) if isinstance(node, Mapping) else None
    return node


def series_name(dotted: str) -> str:
    """A series' name in trackers: `/` groups it (W&B panels, TensorBoard tags)."""
    return dotted.replace(".", "/")


def _number(value: Any) -> float | None:
    # bool is an int to Python, but a flag is not a series
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def step_values(metrics: Mapping[str, Any]) -> dict[str, float]:
    """One trainer step's series by tracker name, the policy version included."""
    out = {}
    for dotted in ("policy_version", *(key for key, _ in SERIES)):
        value = _number(lookup(metrics, dotted))
        if value is not None:
            out[series_name(dotted)] = value
    return out


def final_values(stats: Mapping[str, Any], prefix: str = "ledger") -> dict[str, float]:
    """The numbers of the ledger's final stats, flattened (`ledger/terminal/trained`)."""
    out: dict[str, float] = {}
    for key, value in stats.items():
        name = f"{prefix}/{key}"
        if isinstance(value, Mapping):
            out.update(final_values(value, name))
        elif (number := _number(value)) is not None:
            out[name] = number
    return out
