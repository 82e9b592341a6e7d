"""Task registry: the `type` of a task config -> the task class built from it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from pydantic import Field, TypeAdapter

from rlsys.rollout.tasks.arithmetic import ArithmeticTask, ArithmeticTaskConfig
from rlsys.rollout.tasks.base import Task
from rlsys.rollout.tasks.code import CodeTask, CodeTaskConfig

TaskConfig = Annotated[ArithmeticTaskConfig | CodeTaskConfig, Field(discriminator="type")]

TASKS: dict[str, Callable[[Any], Task]] = {
    "arithmetic": ArithmeticTask,
    "code": CodeTask,
}

_ADAPTER: TypeAdapter[Any] = TypeAdapter(TaskConfig)


def parse_task_config(data: dict[str, Any]) -> ArithmeticTaskConfig | CodeTaskConfig:
    """Validate a plain dict (e.g. from YAML) into the config its `type` names."""
    return _ADAPTER.validate_python(data)


def build_task(config: ArithmeticTaskConfig | CodeTaskConfig | str) -> Task:
    """The task a config (or a bare task name, with defaults) describes."""
    if isinstance(config, str):
        config = parse_task_config({"type": config})
    return TASKS[config.type](config)
