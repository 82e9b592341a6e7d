"""The one job-config loader of the command line: YAML with `--set` overrides, validated
before anything starts.

Invariant: every command that reads a job config (`run`, `submit`, `align`) reads it here,
and every config error leaves as a `UserError` (exit 2) formatted by the one formatter
(`rlsys.config.errors`), which names the field path (e.g. `sampling.top_p`) and what is
allowed; nothing (no Ray cluster, no ledger row) exists yet when it is raised. Sections
owned by lower layers (task, sandbox, scaffold) are validated with their schemas
(`rlsys.rollout.job_sections`).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlsys.cli.errors import UserError

if TYPE_CHECKING:
    from pydantic import ValidationError

    from rlsys.config.errors import ConfigError
    from rlsys.config.job import JobConfig


def _set_path(data: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = data
    for key in keys[:-1]:
        nxt = node.setdefault(key, {})
        if not isinstance(nxt, dict):
            raise UserError(f"--set {dotted}: {key!r} is not a section")
        node = nxt
    node[keys[-1]] = value


def config_user_error(err: ConfigError | ValidationError, prefix: str = "") -> UserError:
    """A refused config as the one line every command prints (exit 2)."""
    from pydantic import ValidationError

    from rlsys.config.errors import config_error

    if isinstance(err, ValidationError):
        err = config_error(err, prefix)
    return UserError(f"invalid config: {err}")


def _gpus_exist(cfg: JobConfig) -> None:
    if (cfg.engine.placement.num_gpus or cfg.trainer.num_gpus) and not (
        shutil.which("nvidia-smi") or os.environ.get("RAY_ADDRESS")
    ):
        raise UserError(
            "invalid config: engine.placement.num_gpus / trainer.num_gpus: > 0 but this "
            "machine has no GPU (set them to 0, or submit to a cluster with GPUs)"
        )


def load_job_config(
    path: str, sets: tuple[str, ...] = (), *, places_replicas: bool = True
) -> JobConfig:
    """The validated `JobConfig` of `path` with `--set key.path=value` overrides applied.

    `places_replicas`: the command places the job's actors on Ray, so GPUs it asks for
    must exist here or on a cluster (`align` places nothing: its `--backend` picks)."""
    import yaml
    from pydantic import ValidationError

    from rlsys.config.errors import ConfigError
    from rlsys.config.job import JobConfig
    from rlsys.rollout.job_sections import validate_owned_sections

    file = Path(path)
    if not file.is_file():
        raise UserError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as err:
        raise UserError(f"config {path} is not valid YAML: {str(err).splitlines()[0]}") from err
    except OSError as err:
        raise UserError(f"config {path}: {err.strerror}") from err
    if not isinstance(data, dict):
        raise UserError(f"config {path} must be a mapping at the top level")
    for item in sets:
        if "=" not in item:
            raise UserError(f"--set {item!r}: expected key.path=value")
        key, raw = item.split("=", 1)
        _set_path(data, key.strip(), yaml.safe_load(raw))
    try:
        cfg = JobConfig.model_validate(data)
        validate_owned_sections(cfg)
    except (ValidationError, ConfigError) as err:
        raise config_user_error(err) from err
    if places_replicas:
        _gpus_exist(cfg)
    return cfg
