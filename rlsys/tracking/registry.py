"""Tracker `type` -> how to open one (the config's `tracking:` entries name these).

Opening imports the tracker's library; nothing here does at import time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlsys.tracking.base import RunInfo, Tracker
from rlsys.tracking.mlflow_tracker import MlflowTracker
from rlsys.tracking.tensorboard_tracker import TensorboardTracker
from rlsys.tracking.wandb_tracker import WandbTracker

TRACKERS: dict[str, Callable[[Any, RunInfo], Tracker]] = {
    "wandb": WandbTracker.open,
    "mlflow": MlflowTracker.open,
    "tensorboard": TensorboardTracker.open,
}
