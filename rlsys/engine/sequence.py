"""One request's state inside the engine.

Invariants:
- `tokens` is prompt + generated; the runner cache `cache_key` covers tokens[:num_cached].
- The rows still to feed are tokens[num_cached:]; when none are left, `ready_logits` holds
  the logits of the last row and the next step samples from them.
- `routes` holds the routed experts of input rows [0, num_cached) (see route_log).
- Speculative decoding: `drafts` are the MTP heads' guesses of the tokens after tokens[-1].
  A verify step feeds tokens[-1] + drafts; until the step's sampling settles, the cache and
  `routes` also cover `spec_rows` draft rows beyond num_cached, whose logits are in
  `verify_logits` (row j predicts the token after draft j).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from rlsys.engine.api import FinishReason, GenerationRequest, GenerationResult
from rlsys.engine.route_log import RouteLog
from rlsys.engine.sampler import RowParams, SampledToken


@dataclass
class Sequence:
    request: GenerationRequest
    stop_sequences: list[list[int]]
    routes: RouteLog
    # what each of its draws needs (parameters, the engine's candidate cap, its uniforms'
    # stream, which owns the request's generator): fixed for the sequence's life, so built
    # once, not per sequence per decode step
    sample_row: RowParams
    tokens: list[int] = field(default_factory=list)
    cache_key: int | None = None
    num_cached: int = 0
    ready_logits: Tensor | None = None
    drafts: list[int] = field(default_factory=list)
    fed_drafts: list[int] = field(default_factory=list)
    spec_rows: int = 0
    verify_logits: Tensor | None = None
    presampled: SampledToken | None = None  # drawn by the step on the device (decode graphs)
    # the decode step on the device that feeds this sequence a row the host has not counted
    # in num_cached yet (`rlsys.engine.core`, overlap), or None
    in_flight: object | None = None
    result: GenerationResult = field(init=False)
    # len(request.prompt_ids), kept: read several times per sequence per decode step
    prompt_len: int = field(init=False)

    def __post_init__(self) -> None:
        self.tokens = list(self.request.prompt_ids)
        self.prompt_len = len(self.tokens)
        self.result = GenerationResult(
            self.request.request_id, prompt_tokens=len(self.tokens), routed_experts=[]
        )

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def num_pending(self) -> int:
        return len(self.tokens) - self.num_cached

    def stop_reason(self, max_context: int) -> FinishReason | None:
        """Why generation ends after the newest token (stop before length), or None.

        O(longest stop sequence) per token: it runs for every sequence at every decode
        step, so it reads only the generated tail, never a copy of the whole generation."""
        tokens = self.tokens
        n_tokens = len(tokens)
        generated = n_tokens - self.prompt_len
        if tokens[-1] in self.request.stop_token_ids:
            return "stop"
        for s in self.stop_sequences:
            if len(s) <= generated and tokens[n_tokens - len(s) :] == s:
                return "stop"
        if generated >= self.request.sampling.max_tokens_per_turn or n_tokens >= max_context:
            return "length"
        return None
