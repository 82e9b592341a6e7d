"""Which prompts a job samples, and when its task counts as solved (pydantic only).

A *task set* is a finite set of prompts, the task's instance indexes 0..N-1. Each prompt
keeps a profile of its recent rewards; the planner draws prompts by how likely a group of
them is to carry a learning signal (rewards that differ), so solved prompts retire and
impossible ones are drawn rarely. Without a task set every group gets a fresh prompt (an
unbounded stream): nothing to steer, and "solved" is judged on recent rollouts.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class CurriculumConfig(BaseModel):
    """Prompt sampling steered by per-prompt pass rates, and the job's `solved` end."""

    model_config = ConfigDict(extra="forbid")

    task_set: int | None = Field(
        None,
        ge=1,
        description="Prompts in the task set (instance indexes 0..N-1), each with a profile "
        "of its recent rewards that steers sampling. None: a fresh prompt per group.",
    )
    steer: bool = Field(
        True,
        description="Draw prompts by the chance that a group of them carries signal (from "
        "their profiles); false: uniformly over the prompts not retired.",
    )
    pass_reward: float = Field(
        1.0, description="A rollout passes when its reward is at least this."
    )
    window: int = Field(8, ge=1, le=1024, description="Recent rollouts a prompt's profile keeps.")
    retire_after: int = Field(
        4,
        ge=1,
        description="A prompt whose last N rollouts all passed is solved and retires: it is "
        "not drawn again.",
    )
    rare_after: int = Field(
        8,
        ge=1,
        description="A prompt whose last N rollouts all failed is drawn with rare_weight only.",
    )
    rare_weight: float = Field(
        0.05, ge=0.0, le=1.0, description="Relative weight of a prompt that looks impossible."
    )
    solved_pass_rate: float | None = Field(
        0.95,
        gt=0.0,
        le=1.0,
        description="The job ends `completed` with the reason `solved` once the task's pass "
        "rate reaches this: over a task set, the mean of every prompt's recent pass rate (a "
        "prompt not yet tried counts 0); without one, over the last solved_window rollouts. "
        "None: never.",
    )
    solved_window: int = Field(
        256, ge=1, description="Rollouts the pass rate is judged on without a task set."
    )

    @model_validator(mode="after")
    def _fits_window(self) -> CurriculumConfig:
        for name in ("retire_after", "rare_after"):
            if getattr(self, name) > self.window:
                raise ValueError(
                    f"{name} ({getattr(self, name)}) must be <= window ({self.window}): a "
                    "profile only remembers that many rollouts"
                )
        return self
