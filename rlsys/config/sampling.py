"""How the policy samples: the one sampling class.

Invariants:
- The job's `sampling` section is this class, and so is what every generation request
  carries (`GenerationRequest.sampling`, `rlsys.engine.api`): the agent loop sends the
  job's object with one turn's `max_tokens_per_turn`, and the engine's sampler reads it
  as it is. Its ranges are checked here, once, when it is made; nothing downstream
  re-declares or re-checks them.
- What is a request's own (stop ids and strings, a seed) lives on the request; the cap on
  recorded candidates is the engine's (`engine.candidate_cap`, `rlsys.config.engine`).
- The trainer reads `temperature` from it, so both sides divide the logits by one number.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class SamplingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(1.0, gt=0, le=10, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus mass.")
    top_k: int = Field(0, ge=0, description="Top-k cut (0 = off).")
    max_tokens_per_turn: int = Field(
        96, ge=1, description="Max generated tokens per turn (per generation request)."
    )
