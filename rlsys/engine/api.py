"""The contract between the inference engine and its callers (scaffolds, actors, trainer).

Plain dataclasses, no torch at import: a scaffold, the admission scheduler or a test fake
can speak it without loading the model. The engine fills, for every generated token, its
id, log-prob, the policy version that produced it, the top-p candidate set it was sampled
from, and the routed experts (a compact payload the trainer replays; opaque to callers).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from rlsys.config.sampling import SamplingConfig

FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. `candidate_cap` bounds the recorded top-p candidate set."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None
    candidate_cap: int = 64

    @classmethod
    def from_config(cls, sampling: SamplingConfig, candidate_cap: int) -> SamplingParams:
        """A request's sampling from the job's one sampling configuration."""
        return cls(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            max_tokens=sampling.max_tokens_per_turn,
            candidate_cap=candidate_cap,
        )


@dataclass(frozen=True)
class GenerationRequest:
    """One turn's generation: `prompt_ids` is the whole context so far (token ids)."""

    request_id: str
    session_id: str
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class GenerationResult:
    """What the engine produced for one request, token-aligned lists."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    candidate_ids: list[list[int]] = field(default_factory=list)
    candidate_capped: list[bool] = field(default_factory=list)
    routed_experts: Any = None  # engine-defined compact payload, one entry per token
    # Routes of the prompt's input rows [0, len(prompt) - 1) (row r = the token at position
    # r fed to the model); with `routed_experts` they cover every row of prompt + tokens[:-1].
    prompt_routed_experts: Any = None
    # A request a weight update interrupted: (version, routes of rows [0, n) as that version
    # computed them) per superseded version. The engine recomputed those rows under the new
    # weights; `prompt_routed_experts` and `routed_experts` then hold the new version's.
    superseded_routes: list[tuple[int, Any]] = field(default_factory=list)
    finish_reason: FinishReason = "stop"
    error: str | None = None
    prefix_cache_hit_tokens: int = 0
    prompt_tokens: int = 0


class Generator(Protocol):
    """Anything that can run a generation request: the engine, a replica actor, a fake."""

    def generate(self, request: GenerationRequest) -> GenerationResult: ...
