"""What an engine reports about itself (`EngineCore.stats`, and the other backends'): one
frozen record per call, counters since start-up and the state at the call."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    version: int
    running: int
    waiting: int
    steps: int
    generated_tokens: int
    forward_rows: int
    tokens_per_s: float
    prompt_tokens: int
    prefix_cache_hit_tokens: int
    prefix_cache_hit_rate: float
    prefix_cache_entries: int
    draft_tokens: int
    accepted_draft_tokens: int
