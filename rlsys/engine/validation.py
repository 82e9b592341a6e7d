"""Checks on a request before it is admitted: a bad request fails alone, with one clear line.

Invariant: a request that passes these checks cannot make the forward step raise (ids in
the vocabulary, a context that fits), so one bad request never fails the batch it would
have joined.
"""

from __future__ import annotations

from rlsys.config.sampling import SamplingConfig
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
    """What the request itself adds to its sampling (the `SamplingConfig` it carries was
    validated when it was made: temperature, top-p/k and the token budget are not
    checked again here)."""
    r = request
    checks = [
        (
            isinstance(r.sampling, SamplingConfig),
            f"sampling={type(r.sampling).__name__}: must be a SamplingConfig",
        ),
        (
            all(isinstance(t, int) and 0 <= t < vocab_size for t in r.stop_token_ids),
            f"stop_token_ids={r.stop_token_ids!r} must be ids in [0, {vocab_size})",
        ),
        (
            all(isinstance(t, str) and t for t in r.stop_strings),
            f"stop_strings={r.stop_strings!r} must be non-empty strings",
        ),
        (
            r.seed is None or (isinstance(r.seed, int) and 0 <= r.seed < 2**63),
            f"seed={r.seed!r} must be an int in [0, 2**63)",
        ),
    ]
    for ok, message in checks:
        if not ok:
            return message
    return None
