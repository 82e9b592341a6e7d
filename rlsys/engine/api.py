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
class GenerationRequest:
    """One turn's generation: `prompt_ids` is the whole context so far (token ids).

    `sampling` is the job's one sampling configuration, validated when it was made
    (`max_tokens_per_turn` bounds this request's generated tokens); the engine's
    `candidate_cap` bounds the recorded candidate sets. What is this request's own: the
    stop ids and strings, and a seed (None: derived from the engine seed and the id).
    """

    request_id: str
    session_id: str
    prompt_ids: list[int]
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None


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
