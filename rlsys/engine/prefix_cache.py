"""Prefix cache: model caches of earlier sequences, keyed by the token ids they cover.

A multi-turn session's next prompt is its previous prompt + generated tokens + an
observation, so the finished turn's cache (covering prompt + generated[:-1]) is a prefix of
it. Invariants:
- An entry covers tokens [0, L) exactly, under one policy version; it holds the logits of
  row L - 1 and the routes of rows [0, L), so a hit reproduces bitwise what a fresh prefill
  of those L tokens would give (caches are row-invariant; tests/engine checks it).
- Lookup returns the longest entry that is a prefix of the prompt, of the current version
  only; `clear` (on a weight update) drops everything.
- Capacity is counted in cached tokens; the least recently used entries are evicted and
  their runner caches released.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from rlsys.engine.route_log import RouteLog


@dataclass
class PrefixEntry:
    tokens: tuple[int, ...]
    cache_key: int
    last_logits: Tensor
    routes: RouteLog
    version: int


class PrefixCache:
    """LRU map from token tuples to runner caches (see module doc)."""

    def __init__(self, capacity_tokens: int, release: Callable[[int], None]) -> None:
        self.capacity_tokens = capacity_tokens
        self._release = release
        self._entries: OrderedDict[tuple[int, ...], PrefixEntry] = OrderedDict()
        self._lengths: dict[int, int] = {}  # length -> number of entries of that length
        self.cached_tokens = 0
        self.prompt_tokens = 0
        self.hit_tokens = 0

    def __contains__(self, tokens: tuple[int, ...]) -> bool:
        return tokens in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt: list[int], version: int) -> PrefixEntry | None:
        """Longest entry of `version` whose tokens prefix `prompt`; counts the hit rate."""
        self.prompt_tokens += len(prompt)
        for length in sorted(self._lengths, reverse=True):
            if length > len(prompt):
                continue
            entry = self._entries.get(tuple(prompt[:length]))
            if entry is not None and entry.version == version:
                self._entries.move_to_end(entry.tokens)
                self.hit_tokens += length
                return entry
        return None

    def insert(self, entry: PrefixEntry) -> bool:
        """Add an entry (False and release it when it does not fit or already exists)."""
        length = len(entry.tokens)
        if length == 0 or length > self.capacity_tokens or entry.tokens in self._entries:
            self._release(entry.cache_key)
            return False
        while self.cached_tokens + length > self.capacity_tokens:
            self._evict(next(iter(self._entries)))
        self._entries[entry.tokens] = entry
        self._lengths[length] = self._lengths.get(length, 0) + 1
        self.cached_tokens += length
        return True

    def clear(self) -> None:
        for tokens in list(self._entries):
            self._evict(tokens)

    @property
    def hit_rate(self) -> float:
        """Prompt tokens served from the cache / prompt tokens looked up."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def _evict(self, tokens: tuple[int, ...]) -> None:
        entry = self._entries.pop(tokens)
        length = len(tokens)
        self._lengths[length] -= 1
        if not self._lengths[length]:
            del self._lengths[length]
        self.cached_tokens -= length
        self._release(entry.cache_key)
