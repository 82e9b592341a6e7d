"""Experiment trackers a job reports to: one small config per tracker, chosen by `type`.

The job config holds a list (`tracking:`), each entry validated by the class its `type`
names; `rlsys.tracking.registry.TRACKERS` maps the same names to implementations (a test
keeps the two in step). Pydantic only: the trackers' packages are imported when a job
opens them, never here.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Tracker(BaseModel):
    model_config = ConfigDict(extra="forbid")


class WandbTracking(_Tracker):
    """Weights & Biases (needs `rlsys[tracking]` where the job's driver runs)."""

    type: Literal["wandb"]
    project: str = Field("rlsys", min_length=1, description="W&B project.")
    entity: str | None = Field(None, description="W&B entity (team or user); default: yours.")
    mode: Literal["online", "offline"] = Field(
        "online",
        description="online needs WANDB_API_KEY where the driver runs; offline writes the run "
        "under `dir` for a later `wandb sync`.",
    )
    dir: str | None = Field(None, description="Where W&B writes its files (default: the run dir).")
    group: str | None = Field(None, description="W&B run group.")
    tags: list[str] = Field(default_factory=list, description="W&B run tags.")


class MlflowTracking(_Tracker):
    """MLflow (needs `rlsys[tracking]` where the job's driver runs)."""

    type: Literal["mlflow"]
    tracking_uri: str | None = Field(
        None,
        description="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else MLflow's own). "
        "A file: store needs MLFLOW_ALLOW_FILE_STORE=true with MLflow 3.",
    )
    experiment: str = Field("rlsys", min_length=1, description="MLflow experiment name.")


class TensorboardTracking(_Tracker):
    """TensorBoard event files, written as the job runs."""

    type: Literal["tensorboard"]
    dir: str | None = Field(
        None, description="Event file directory (default: RUN_DIR/tensorboard)."
    )


TrackerConfig = Annotated[
    WandbTracking | MlflowTracking | TensorboardTracking, Field(discriminator="type")
]
