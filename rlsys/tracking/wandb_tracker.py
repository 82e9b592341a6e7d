"""Weights & Biases: one W&B run per job, with the job id as its id and name.

The resolved config is the run's config; each trainer step is one `log` at that step; the
ledger's final stats go to the run summary. A resumed job continues its run (same id).
Offline mode writes the run under `dir` (`wandb sync` uploads it later).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rlsys.config.tracking import WandbTracking
from rlsys.tracking.base import SUCCEEDED, RunInfo, missing_package


class WandbTracker:
    def __init__(self, run: Any) -> None:
        self.run = run

    @classmethod
    def open(cls, cfg: WandbTracking, info: RunInfo) -> WandbTracker:
        try:
            import wandb
        except ImportError as err:
            raise missing_package("wandb", "wandb") from err
        directory = Path(cfg.dir) if cfg.dir else info.run_dir
        directory.mkdir(parents=True, exist_ok=True)
        run = wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            mode=cfg.mode,
            dir=str(directory),
            id=info.job_id,
            name=info.job_id,
            resume="allow",
            group=cfg.group,
            tags=cfg.tags or None,
            job_type="rl",
            config=info.config,
            # a job's own run, never the process-global one: two jobs in one process
            # (tests, notebooks) must not log into each other
            reinit="create_new",
            # the driver's output already goes to Ray's job logs (`rlsys jobs logs`)
            settings=wandb.Settings(console="off"),
        )
        return cls(run)

    def log_step(self, step: int, values: Mapping[str, float]) -> None:
        self.run.log(dict(values), step=step)

    def finish(self, status: str, final: Mapping[str, float], stats: Mapping[str, Any]) -> None:
        self.run.summary.update({**final, "ledger/job_status": status})
        self.run.finish(exit_code=0 if status == SUCCEEDED else 1)
