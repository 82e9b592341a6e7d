"""MLflow: one MLflow run per job, found again by its `rlsys.job_id` tag when it resumes.

The resolved config becomes the run's params (dotted keys) and its `config.json`
artifact; each trainer step is one batch of metrics at that step; the ledger's final
stats are metrics at the last step and the `ledger_stats.json` artifact, and the run ends
FINISHED, KILLED (stopped) or FAILED. The client is explicit (`MlflowClient`), so no
process-global active run is touched.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from rlsys.config.tracking import MlflowTracking
from rlsys.tracking.base import SUCCEEDED, RunInfo, flat_config, missing_package

JOB_TAG = "rlsys.job_id"
END_STATUS = {SUCCEEDED: "FINISHED", "stopped": "KILLED"}  # anything else: FAILED
PARAMS_PER_BATCH = 100  # MLflow's limit per log_batch call
MAX_PARAM_CHARS = 500  # longer values are cut; the whole config is in config.json


class MlflowTracker:
    def __init__(self, client: Any, run_id: str) -> None:
        self.client, self.run_id = client, run_id
        self.last_step = 0

    @classmethod
    def open(cls, cfg: MlflowTracking, info: RunInfo) -> MlflowTracker:
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as err:
            raise missing_package("mlflow", "mlflow-skinny") from err
        client = MlflowClient(tracking_uri=cfg.tracking_uri)
        experiment = client.get_experiment_by_name(cfg.experiment)
        experiment_id = (
            experiment.experiment_id if experiment else client.create_experiment(cfg.experiment)
        )
        found = client.search_runs(
            [experiment_id], filter_string=f"tags.`{JOB_TAG}` = '{info.job_id}'", max_results=1
        )
        if found:  # a resumed job: its params are already there (and immutable)
            run_id = found[0].info.run_id
            client.update_run(run_id, status="RUNNING")
            return cls(client, run_id)
        run_id = client.create_run(
            experiment_id,
            run_name=info.job_id,
            tags={JOB_TAG: info.job_id, "rlsys.job_name": info.name},
        ).info.run_id
        tracker = cls(client, run_id)
        tracker._log_config(info.config)
        return tracker

    def _log_config(self, config: dict[str, Any]) -> None:
        from mlflow.entities import Param

        params = [Param(k, v[:MAX_PARAM_CHARS]) for k, v in flat_config(config).items()]
        for i in range(0, len(params), PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[i : i + PARAMS_PER_BATCH])
        self.client.log_dict(self.run_id, config, "config.json")

    def log_step(self, step: int, values: Mapping[str, float]) -> None:
        self._log_metrics(step, values)
        self.last_step = step

    def _log_metrics(self, step: int, values: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        metrics = [Metric(k, v, now_ms, step) for k, v in values.items()]
        for i in range(0, len(metrics), PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + PARAMS_PER_BATCH])

    def finish(self, status: str, final: Mapping[str, float], stats: Mapping[str, Any]) -> None:
        self._log_metrics(self.last_step, final)
        self.client.set_tag(self.run_id, "rlsys.job_status", status)
        self.client.log_dict(self.run_id, dict(stats), "ledger_stats.json")
        self.client.set_terminated(self.run_id, END_STATUS.get(status, "FAILED"))
