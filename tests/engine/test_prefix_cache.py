"""The prefix cache: longest-prefix lookup, version isolation, LRU eviction by tokens."""

from __future__ import annotations

import pytest
import torch

from rlsys.engine.prefix_cache import PrefixCache, PrefixEntry
from rlsys.engine.route_log import RouteLog

pytestmark = pytest.mark.unit


def entry(tokens: list[int], key: int, version: int = 0) -> PrefixEntry:
    return PrefixEntry(tuple(tokens), key, torch.zeros(4), RouteLog(4), version)


def test_lookup_returns_the_longest_prefix_of_the_current_version() -> None:
    released: list[int] = []
    cache = PrefixCache(100, released.append)
    cache.insert(entry([1, 2], 0))
    cache.insert(entry([1, 2, 3, 4], 1))
    cache.insert(entry([1, 2, 3, 4, 5, 6], 2, version=1))
    hit = cache.lookup([1, 2, 3, 4, 5, 6, 7], version=0)
    assert hit is not None and hit.cache_key == 1
    assert cache.lookup([9, 1, 2], version=0) is None
    assert cache.hit_tokens == 4 and cache.prompt_tokens == 10


def test_capacity_evicts_least_recently_used_and_releases_caches() -> None:
    released: list[int] = []
    cache = PrefixCache(6, released.append)
    cache.insert(entry([1, 2, 3], 0))
    cache.insert(entry([4, 5, 6], 1))
    cache.lookup([1, 2, 3, 9], version=0)  # touches [1, 2, 3]
    cache.insert(entry([7, 8], 2))
    assert released == [1] and cache.cached_tokens == 5
    assert not cache.insert(entry([1, 2, 3], 3)) and released == [1, 3]  # duplicate
    cache.clear()
    assert len(cache) == 0 and sorted(released) == [0, 1, 2, 3]
