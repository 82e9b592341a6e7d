"""Loading a job config from YAML with `--set` overrides, validated before anything starts.

Invariant: every error is a `UserError` naming the field path (e.g. `engine.replicas`) and
what is allowed; nothing (no Ray cluster, no ledger row) exists yet when it is raised.
Sections owned by lower layers (task, sandbox, scaffold) are validated with their schemas.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlsys.cli.errors import UserError


def _set_path(data: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = data
    for key in keys[:-1]:
        nxt = node.setdefault(key, {})
        if not isinstance(nxt, dict):
            raise UserError(f"--set {dotted}: {key!r} is not a section")
        node = nxt
    node[keys[-1]] = value


def _format_pydantic(err: Any, prefix: str = "") -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"] if not str(p).startswith("function-after"))
        path = ".".join(p for p in (prefix, loc) if p) or "(config)"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        if e["type"] == "literal_error":
            msg = f"{msg} (got {e.get('input')!r})"
        lines.append(f"{path}: {msg}")
    return "invalid config: " + "; ".join(lines)


def load_job_config(path: str, sets: tuple[str, ...] = ()) -> Any:
    """The validated `JobConfig` of `path` with `--set key.path=value` overrides applied."""
    import yaml
    from pydantic import ValidationError

    from rlsys.config.job import JobConfig

    file = Path(path)
    if not file.is_file():
        raise UserError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(file.read_text()) or {}
    except yaml.YAMLError as err:
        raise UserError(f"config {path} is not valid YAML: {str(err).splitlines()[0]}") from err
    if not isinstance(data, dict):
        raise UserError(f"config {path} must be a mapping at the top level")
    for item in sets:
        if "=" not in item:
            raise UserError(f"--set {item!r}: expected key.path=value")
        key, raw = item.split("=", 1)
        _set_path(data, key.strip(), yaml.safe_load(raw))
    try:
        cfg = JobConfig.model_validate(data)
    except ValidationError as err:
        raise UserError(_format_pydantic(err)) from err
    from rlsys.actors.job_sections import validate_owned_sections

    try:
        validate_owned_sections(cfg)
    except ValidationError as err:
        raise UserError(_format_pydantic(err)) from err
    except ValueError as err:
        raise UserError(f"invalid config: {err}") from err
    return cfg
