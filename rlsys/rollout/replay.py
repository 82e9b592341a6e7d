"""A `Generator` that replays scripted policy turns: demonstrations and tests.

It stands in for the engine at the outer edge: each request gets the next scripted text,
encoded byte-level, with log-prob 0.0 and a fixed policy version. A script entry may also
be a callable that sees the request (to react to the context) or an exception to raise
(an engine failure).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from rlsys.engine.api import GenerationRequest, GenerationResult
from rlsys.tokenizer import ByteTokenizer

ScriptEntry = str | list[int] | BaseException | Callable[[GenerationRequest], str | list[int]]


@dataclass
class ReplayGenerator:
    script: Sequence[ScriptEntry]
    version: int = 0
    requests: list[GenerationRequest] = field(default_factory=list)
    results: list[GenerationResult] = field(default_factory=list)

    def generate(self, request: GenerationRequest) -> GenerationResult:
        self.requests.append(request)
        if len(self.requests) > len(self.script):
            raise RuntimeError(f"script exhausted after {len(self.script)} turns")
        entry = self.script[len(self.requests) - 1]
        if isinstance(entry, BaseException):
            raise entry
        produced = entry(request) if callable(entry) else entry
        ids = ByteTokenizer().encode(produced) if isinstance(produced, str) else list(produced)
        ids = ids[: request.sampling.max_tokens_per_turn]
        result = GenerationResult(
            request_id=request.request_id,
            token_ids=ids,
            logprobs=[0.0] * len(ids),
            versions=[self.version] * len(ids),
            finish_reason="stop" if len(ids) < request.sampling.max_tokens_per_turn else "length",
            prompt_tokens=len(request.prompt_ids),
        )
        self.results.append(result)
        return result
