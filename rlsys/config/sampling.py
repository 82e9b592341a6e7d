"""How the policy samples: the one sampling configuration of a job.

The job's `sampling` section is this class; the agent loop holds it (`ScaffoldConfig`) and
turns it into each request's `SamplingParams` (`rlsys.engine.api`, the engine's wire form,
which adds what is per request: stop strings, a seed, the candidate cap of the engine).
The trainer reads `temperature` from it, so both sides divide the logits by one number.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class SamplingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(1.0, gt=0, le=10, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus mass.")
    top_k: int = Field(0, ge=0, description="Top-k cut (0 = off).")
    max_tokens_per_turn: int = Field(96, ge=1, description="Max generated tokens per turn.")
