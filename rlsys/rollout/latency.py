"""Simulated environment latency of tool calls: long-tailed, deterministic per rollout.

Agentic environments are slow in a long-tailed way (a compile, a test suite, a web page):
most tool calls take about the median, a few take many times longer. Benchmarks that
compare pipelines (async against sync, `benchmarks/bench_async_vs_sync.py`) need that shape
without a real slow environment, so the scaffold can add a lognormal delay before each
observation (a tool's output or its error). Off by default; it never changes what the
environment returns, only when.

Invariants: a delay is a pure function of (rollout id, turn) and the config, so the same
rollout waits the same time in every pipeline; it never exceeds `max_s`.
"""

from __future__ import annotations

import math
import random

from pydantic import BaseModel, ConfigDict, Field


class ToolLatencyConfig(BaseModel):
    """Lognormal delay before every observation: exp(N(ln median, sigma^2)), capped."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    median_s: float = Field(gt=0, le=600, description="Median delay per tool call.")
    sigma: float = Field(
        1.0, ge=0, le=4, description="Lognormal shape: 1 gives p99 ~10x median, 1.5 ~33x."
    )
    max_s: float = Field(60.0, gt=0, le=3600, description="No delay is longer than this.")


def tool_delay_s(config: ToolLatencyConfig, rollout_id: str, turn: int) -> float:
    """The delay of `rollout_id`'s observation after turn `turn`, in seconds."""
    rng = random.Random(f"tool-latency:{rollout_id}:{turn}")
    return min(config.max_s, math.exp(rng.gauss(math.log(config.median_s), config.sigma)))
