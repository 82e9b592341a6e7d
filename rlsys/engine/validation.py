"""Checks on a request before it is admitted: a bad request fails alone, with one clear line.

Invariant: a request that passes these checks cannot make the forward step raise (ids in
the vocabulary, a context that fits), so one bad request never fails the batch it would
have joined.
"""

from __future__ import annotations

import math

from rlsys.engine.api import GenerationRequest


def request_error(request: GenerationRequest, vocab_size: int, max_context: int) -> str | None:
    """Why `request` cannot run, or None."""
    prompt = request.prompt_ids
    if not prompt:
        return "prompt_ids is empty: a request needs at least one token"
    if len(prompt) >= max_context:
        return (
            f"prompt has {len(prompt)} tokens; the context budget is {max_context} "
            "(prompt + at least one generated token)"
        )
    for i, tok in enumerate(prompt):
        if not isinstance(tok, int) or not 0 <= tok < vocab_size:
            return f"prompt_ids[{i}]={tok!r} is not a token id in [0, {vocab_size})"
    return sampling_error(request, vocab_size)


def sampling_error(request: GenerationRequest, vocab_size: int) -> str | None:
    s = request.sampling
    checks = [
        (
            isinstance(s.temperature, int | float)
            and math.isfinite(s.temperature)
            and s.temperature > 0,
            f"sampling.temperature={s.temperature!r} must be a finite number > 0 (top_k=1 is greedy)",
        ),
        (
            isinstance(s.top_p, int | float) and 0 < s.top_p <= 1,
            f"sampling.top_p={s.top_p!r} must be in (0, 1]",
        ),
        (isinstance(s.top_k, int) and s.top_k >= 0, f"sampling.top_k={s.top_k!r} must be >= 0"),
        (
            isinstance(s.max_tokens, int) and s.max_tokens >= 1,
            f"sampling.max_tokens={s.max_tokens!r} must be >= 1",
        ),
        (
            isinstance(s.candidate_cap, int) and s.candidate_cap >= 1,
            f"sampling.candidate_cap={s.candidate_cap!r} must be >= 1",
        ),
        (
            all(isinstance(t, int) and 0 <= t < vocab_size for t in s.stop_token_ids),
            f"sampling.stop_token_ids={s.stop_token_ids!r} must be ids in [0, {vocab_size})",
        ),
        (
            all(isinstance(t, str) and t for t in s.stop_strings),
            f"sampling.stop_strings={s.stop_strings!r} must be non-empty strings",
        ),
        (
            s.seed is None or (isinstance(s.seed, int) and 0 <= s.seed < 2**63),
            f"sampling.seed={s.seed!r} must be an int in [0, 2**63)",
        ),
    ]
    for ok, message in checks:
        if not ok:
            return message
    return None
