"""Config errors as a user reads them: `field.path: what is wrong`, one formatter for all.

Invariants:
- `config_error` is the one place a pydantic `ValidationError` of any config (the job, a
  section another layer owns, a model preset's overrides) becomes text; the CLI prints
  `ConfigError`s and nothing else formats validation errors.
- Every issue names the field path of the value at fault, as the job's YAML spells it:
  a section validated on its own is prefixed with where it sits in the job
  (`rollout.task.max_factor`), a discriminated union's tag is not a path part, and a
  message that already names its field (a cross-field check) is not prefixed again.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError


class ConfigError(ValueError):
    """A refused config; `issues` are its (field path, message) pairs."""

    def __init__(self, issues: list[tuple[str, str]]) -> None:
        self.issues = issues
        super().__init__("; ".join(_line(path, msg) for path, msg in issues))


def _line(path: str, msg: str) -> str:
    if not path or msg.startswith(path):
        return msg
    return f"{path}: {msg}"


def _message(error: Any) -> str:
    if error["type"] in ("extra_forbidden", "extra_forbid"):
        return "unknown key"
    msg = str(error["msg"]).removeprefix("Value error, ")
    if error["type"] == "literal_error":
        msg = f"{msg} (got {error.get('input')!r})"
    return msg


def config_error(err: ValidationError, prefix: str = "", tag: Any = None) -> ConfigError:
    """`err` as a `ConfigError` whose paths start with `prefix` (where the validated
    section sits in the job); `tag`: the discriminator value of a tagged union, dropped."""
    issues = []
    for e in err.errors():
        parts = [str(p) for p in e["loc"] if not str(p).startswith("function-")]
        if parts and tag is not None and parts[0] == str(tag):
            parts = parts[1:]
        path = ".".join(p for p in (prefix, *parts) if p)
        issues.append((path, _message(e)))
    return ConfigError(issues)
