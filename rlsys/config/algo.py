"""Configuration of the RL objective (pydantic only: importable without torch)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


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
    filter_zero_variance: bool = Field(True, description="Drop groups whose rewards are all equal.")
