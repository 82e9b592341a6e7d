"""The job sections other layers own (task, sandbox, scaffold), validated by their schemas.

No Ray here: the CLI imports this to validate a config before anything starts.
Errors: pydantic `ValidationError` whose locations are prefixed with the section path, or
`ValueError("section.path: what is wrong")`.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

from pydantic import ValidationError

from rlsys.config.job import JobConfig
from rlsys.rollout.scaffold import ScaffoldConfig
from rlsys.rollout.tasks.registry import parse_task_config
from rlsys.sandboxes.registry import parse_sandbox_config


def _prefixed(prefix: str, err: ValidationError, tag: Any = None) -> ValueError:
    """Errors as `section.field: message`; a discriminated union's tag is not a field."""
    parts = []
    for e in err.errors():
        loc_parts = [str(p) for p in e["loc"] if not str(p).startswith("function-after")]
        if loc_parts and tag is not None and loc_parts[0] == str(tag):
            loc_parts = loc_parts[1:]
        loc = ".".join(loc_parts)
        msg = (
            "unknown key"
            if e["type"] == "extra_forbid" or e["type"] == "extra_forbidden"
            else e["msg"]
        )
        parts.append(f"{prefix}.{loc}: {msg}".replace(". :", ":").rstrip("."))
    return ValueError("; ".join(parts))


def validate_owned_sections(cfg: JobConfig) -> None:
    checks = (
        ("rollout.task", cfg.rollout.task, lambda: parse_task_config(cfg.rollout.task)),
        ("rollout.sandbox", cfg.rollout.sandbox, lambda: parse_sandbox_config(cfg.rollout.sandbox)),
        ("rollout.scaffold", {}, lambda: scaffold_config(cfg)),
    )
    for prefix, section, check in checks:
        try:
            check()
        except ValidationError as err:
            raise _prefixed(prefix, err, section.get("type")) from err
        except (ValueError, KeyError) as err:
            raise ValueError(f"{prefix}: {err}") from err
    if (cfg.engine.num_gpus or cfg.trainer.num_gpus) and not (
        shutil.which("nvidia-smi") or os.environ.get("RAY_ADDRESS")
    ):
        raise ValueError(
            "engine.num_gpus / trainer.num_gpus: > 0 but this machine has no GPU "
            "(set them to 0, or submit to a cluster with GPUs)"
        )


def scaffold_config(cfg: JobConfig) -> ScaffoldConfig:
    """The scaffold config, with sampling taken from the `sampling` and `engine` sections."""
    owned = {"sampling", "temperature", "top_p", "top_k", "max_new_tokens", "candidate_cap"}
    clash = owned & set(cfg.rollout.scaffold)
    if clash:
        raise ValueError(
            f"set {sorted(clash)} in the sampling/engine sections, not in the scaffold"
        )
    data: dict[str, Any] = {
        "context_budget": cfg.engine.max_context_tokens,
        **cfg.rollout.scaffold,
        "sampling": cfg.sampling,
        "candidate_cap": cfg.engine.candidate_cap,
    }
    scaffold = ScaffoldConfig.model_validate(data)
    turn = scaffold.max_new_tokens + scaffold.max_observation_tokens
    if turn >= scaffold.context_budget:
        raise ValueError(
            f"one turn (sampling.max_tokens_per_turn {scaffold.max_new_tokens} + "
            f"rollout.scaffold.max_observation_tokens {scaffold.max_observation_tokens}) does not "
            f"fit the context budget {scaffold.context_budget} (engine.max_context_tokens)"
        )
    return scaffold
