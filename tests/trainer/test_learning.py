"""The learning check (issue 6): on the quickstart's tool-use task, with trajectories the real
engine generates, RL raises the mean reward of a held-out evaluation, and the zero-center
projection does not make it worse.

It runs `benchmarks/learn_arithmetic.py`'s loop (no Ray, staleness 0): a 70-step supervised
warm start, then 12 RL steps of 8 groups x 4 rollouts at lr 2e-4, evaluated on 64 held-out
instances before and after. Deterministic: every request samples from its own seeded
generator and the kernels are batch-invariant, so thread timing changes nothing. About
5 minutes per run on a 2-core CPU (two runs: with and without the projection).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.learning

HARNESS = Path(__file__).resolve().parents[2] / "benchmarks" / "learn_arithmetic.py"
ARGS = [
    "--warm-steps", "70", "--steps", "12", "--groups", "8", "--group-size", "4",
    "--lr", "2e-4", "--warmup", "5", "--eval", "64", "--content-weight", "1.0",
]  # fmt: skip


def _learn(zero_center: str) -> dict:
    spec = importlib.util.spec_from_file_location("learn_arithmetic", HARNESS)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve annotations through it
    spec.loader.exec_module(module)
    return module.run(module.parser().parse_args([*ARGS, "--zero-center", zero_center]))


@pytest.fixture(scope="module")
def with_zero_center() -> dict:
    return _learn("on")


def test_rl_raises_the_held_out_reward(with_zero_center: dict) -> None:
    r = with_zero_center
    # Measured on the 2-core CPU: 0.672 -> 0.781. Deterministic on one machine; the margin
    # leaves room for a CPU whose matmuls round differently.
    assert r["after"] >= r["before"] + 0.05, r


def test_zero_center_is_not_worse(with_zero_center: dict) -> None:
    """Compared on what RL adds: the projection also shapes the warm start's gradients, so
    the two runs start from different policies (measured: on 0.672 -> 0.781, off 0.719 ->
    0.844; +0.109 against +0.125, inside the noise of 64 evaluation rollouts)."""
    without = _learn("off")
    gain_on = with_zero_center["after"] - with_zero_center["before"]
    gain_off = without["after"] - without["before"]
    assert gain_on >= gain_off - 0.05, (with_zero_center, without)
