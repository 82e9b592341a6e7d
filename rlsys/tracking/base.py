"""What a tracker is: it opens a run for a job, takes each step's series, and closes the
run with the ledger's final stats.

Invariants: a tracker gets the resolved config once, at open; steps arrive in increasing
order; `finish` is called once, whatever the job's end (completed, stopped, failed).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

# How a job's end status reads to a tracker: succeeded or not.
SUCCEEDED = "completed"


@dataclass(frozen=True)
class RunInfo:
    """The job a tracker's run belongs to."""

    job_id: str
    name: str
    config: dict[str, Any]  # the resolved job config, as stored in the ledger
    run_dir: Path


class Tracker(Protocol):
    def log_step(self, step: int, values: Mapping[str, float]) -> None:
        """Record one trainer step's series (`step_values`)."""
        ...

    def finish(self, status: str, final: Mapping[str, float], stats: Mapping[str, Any]) -> None:
        """Close the run: the job's end status, its final numbers and the full stats."""
        ...


def flat_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """The config as dotted keys and string values (MLflow params, TensorBoard text)."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flat_config(value, name + "."))
        else:
            out[name] = str(value)
    return out


def missing_package(kind: str, package: str) -> RuntimeError:
    return RuntimeError(
        f"tracking type {kind!r} needs the {package} package where the job's driver runs: "
        "pip install 'rlsys[tracking]'"
    )
