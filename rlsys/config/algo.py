"""Configuration of the RL objective (pydantic only: importable without torch)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class CriticConfig(BaseModel):
    """An optional learnable critic: a token-level baseline for the advantages."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(
        False, description="Learn a critic; its baseline replaces the group mean."
    )
    hidden: int = Field(128, ge=1, description="Hidden width of the critic's MLP head.")
    lr: float = Field(1e-3, gt=0, description="Adam learning rate of the critic.")
    warmup_updates: int = Field(
        20,
        ge=0,
        description="Critic updates (pre-training steps and trainer steps) before its baseline "
        "is used; until then the group-relative baseline is.",
    )
    pretrain_steps: int = Field(
        200,
        ge=0,
        description="Value-regression steps the job runs on the warm-start demonstrations "
        "(their returns) before the first RL step, after the warm start (0 = off). Each "
        "counts toward warmup_updates.",
    )


class AlgoConfig(BaseModel):
    """How trajectories become a loss."""

    model_config = ConfigDict(extra="forbid")

    objective: Literal["pg_tis", "ppo_clip"] = Field(
        "pg_tis",
        description="pg_tis: policy gradient with truncated importance weights against the "
        "behaviour log-probs; ppo_clip: PPO clipped surrogate with the behaviour policy as old.",
    )
    aggregation: Literal["token_mean", "seq_mean"] = Field(
        "token_mean",
        description="Average the per-token loss over all tokens, or per sequence first.",
    )
    clip_eps: float = Field(0.2, gt=0, le=1, description="PPO clip range (ppo_clip).")
    tis_cap: float = Field(2.0, ge=1, description="Truncation of importance weights (TIS).")
    normalize_std: bool = Field(
        True, description="Divide group-relative advantages by the group std."
    )
    kl_coef: float = Field(0.0, ge=0, description="Weight of the KL term to the reference policy.")
    max_staleness: int = Field(
        2, ge=0, description="Samples older than this many versions are filtered."
    )
    filter_zero_variance: bool = Field(
        True,
        description="Drop groups whose rewards are all equal (and carry no turn penalty); the "
        "controller replaces each with a new group, so a step still trains "
        "trainer.groups_per_step groups.",
    )
    max_generation_per_step: int | None = Field(
        None,
        ge=1,
        description="Groups generated for one trainer step at most, filtered ones included "
        "(default 16 x trainer.groups_per_step). Past it the step trains the informative "
        "groups it has; with none, the job ends `failed`: no learning signal.",
    )
    critic: CriticConfig = Field(default_factory=CriticConfig)
