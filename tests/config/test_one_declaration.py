"""Sampling and engine settings are declared once (docs/ARCHITECTURE.md, "Configuration"):
one class declares each, with its default and its range; every other holder carries that
class's object (a request's `sampling`) or values read from it (a batch's tensors)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from pydantic import ValidationError

from rlsys.config.sampling import SamplingConfig
from rlsys.engine.api import GenerationRequest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("rlsys", "actors", "ledger", "sandboxes", "kernels")

# field -> the one class that declares it (with a default). (The trainer's own
# `LogProbOptions.temperature` is the divisor it is handed, from `sampling.temperature`.)
DECLARED_ONCE = {
    "top_p": "rlsys/config/sampling.py:SamplingConfig",
    "top_k": "rlsys/config/sampling.py:SamplingConfig",
    "max_tokens_per_turn": "rlsys/config/sampling.py:SamplingConfig",
    "candidate_cap": "rlsys/config/engine.py:EngineConfig",
    "max_context_tokens": "rlsys/config/engine.py:EngineConfig",
    "max_running": "rlsys/config/engine.py:EngineConfig",
    "replicas": "rlsys/config/engine.py:EnginePlacement",
}


def _declarations() -> dict[str, list[str]]:
    """Class fields with a default (a declaration, not a runtime slot), by name."""
    found: dict[str, list[str]] = {}
    for folder in SOURCES:
        for path in (ROOT / folder).rglob("*.py"):
            for cls in ast.walk(ast.parse(path.read_text())):
                if not isinstance(cls, ast.ClassDef):
                    continue
                for node in cls.body:
                    if (
                        isinstance(node, ast.AnnAssign)
                        and isinstance(node.target, ast.Name)
                        and node.value is not None
                        and node.target.id in DECLARED_ONCE
                    ):
                        where = f"{path.relative_to(ROOT).as_posix()}:{cls.name}"
                        found.setdefault(node.target.id, []).append(where)
    return found


def test_each_setting_is_declared_by_exactly_one_class() -> None:
    found = _declarations()
    assert {name: sorted(found.get(name, [])) for name in DECLARED_ONCE} == {
        name: [where] for name, where in DECLARED_ONCE.items()
    }


def test_exactly_one_engine_configuration_class() -> None:
    names = [
        f"{path.relative_to(ROOT).as_posix()}:{node.name}"
        for folder in SOURCES
        for path in (ROOT / folder).rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef)
        and node.name.startswith("Engine")
        and node.name.endswith(("Config", "Section"))
    ]
    assert names == ["rlsys/config/engine.py:EngineConfig"]


def test_sampling_ranges_are_checked_when_the_one_class_is_made() -> None:
    for bad in ({"top_p": 1.5}, {"top_p": 0.0}, {"temperature": 0.0}, {"top_k": -1}):
        with pytest.raises(ValidationError):
            SamplingConfig(**bad)
    sampling = SamplingConfig(top_p=0.9, max_tokens_per_turn=12)
    request = GenerationRequest("r", "s", [1, 2], sampling, stop_strings=("\n",), seed=3)
    assert request.sampling is sampling  # the one object travels; nothing is copied out
