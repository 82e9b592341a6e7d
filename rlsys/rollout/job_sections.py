"""The job sections the rollout layer owns (task, sandbox, scaffold), validated by their
schemas.

The job schema (`rlsys.config.job`) keeps these sections as plain mappings because the
dependency rule keeps `rlsys.config` below the layers that define them; this module, in
the layer that owns them, is where they are validated: by the one job loader
(`rlsys.cli.job_config.load_job_config`) before anything starts, and by the actors that
build them from a job.

Invariants: no Ray and no torch here; every error is a `ConfigError`
(`rlsys.config.errors`) whose paths are prefixed with where the section sits in the job.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pydantic import ValidationError

from rlsys.config.errors import ConfigError, config_error
from rlsys.config.job import JobConfig
from rlsys.rollout.scaffold import ScaffoldConfig
from rlsys.rollout.tasks.registry import parse_task_config
from rlsys.sandboxes.registry import parse_sandbox_config

# scaffold keys that belong to the `sampling` and `engine` sections
SET_ELSEWHERE = frozenset(
    {"sampling", "temperature", "top_p", "top_k", "max_new_tokens", "candidate_cap"}
)


def _checked(prefix: str, section: Mapping[str, Any], check: Callable[[], Any]) -> Any:
    try:
        return check()
    except ConfigError:
        raise
    except ValidationError as err:
        raise config_error(err, prefix, section.get("type")) from err
    except (ValueError, KeyError) as err:
        raise ConfigError([(prefix, str(err).strip("'\""))]) from err


def validate_owned_sections(cfg: JobConfig) -> None:
    """Raises `ConfigError` naming the first section at fault."""
    _checked("rollout.task", cfg.rollout.task, lambda: parse_task_config(cfg.rollout.task))
    _checked(
        "rollout.sandbox", cfg.rollout.sandbox, lambda: parse_sandbox_config(cfg.rollout.sandbox)
    )
    scaffold_config(cfg)


def scaffold_config(cfg: JobConfig) -> ScaffoldConfig:
    """The scaffold of job `cfg`: its `rollout.scaffold` section, carrying the job's one
    sampling configuration; the context budget is the engine's unless the section sets it."""
    clash = SET_ELSEWHERE & set(cfg.rollout.scaffold)
    if clash:
        raise ConfigError(
            [("rollout.scaffold", f"set {sorted(clash)} in the sampling/engine sections")]
        )
    data = {"context_budget": cfg.engine.max_context_tokens, **cfg.rollout.scaffold}
    scaffold = _checked(
        "rollout.scaffold",
        {},
        lambda: ScaffoldConfig.model_validate({**data, "sampling": cfg.sampling}),
    )
    turn = scaffold.max_new_tokens + scaffold.max_observation_tokens
    if turn >= scaffold.context_budget:
        raise ConfigError(
            [
                (
                    "rollout.scaffold",
                    f"one turn (sampling.max_tokens_per_turn {scaffold.max_new_tokens} + "
                    "rollout.scaffold.max_observation_tokens "
                    f"{scaffold.max_observation_tokens}) does not fit the context budget "
                    f"{scaffold.context_budget} (engine.max_context_tokens)",
                )
            ]
        )
    return scaffold
