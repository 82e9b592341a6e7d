"""Roll a reference `ModelCache` back to a shorter length after a speculative verify.

A verify forward feeds a sequence's next token plus k drafted ones in one chunk; the drafts
the sampler rejects must leave no trace in the cache. `rollback(before, after, length)`
rebuilds the cache of `length` tokens from the snapshot taken before the verify (`before`,
which shares tensors with the cache: reference caches are never written in place) and the
kept rows of `after`, by re-appending them with the same append functions a forward uses.

Invariant: the result is bit for bit the cache a forward of exactly the kept rows would
have left (same K/V rows, same block merges, same SWA trim). It needs the raw index keys of
the new rows, which `after` holds as long as the verify completed at most one Sparse GQA
block: the caller keeps the verify chunk within `sparse_block` rows.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlsys.config.model import ModelConfig
from rlsys.model.cache import ModelCache, SlidingKVCache, SparseKVCache
from rlsys.model.swa import keep_from


def rollback(before: ModelCache, after: ModelCache, length: int, cfg: ModelConfig) -> ModelCache:
    """The cache of the first `length` tokens (before.length <= length <= after.length)."""
    assert before.length <= length <= after.length, (before.length, length, after.length)
    layers = []
    for old, new in zip(before.layers, after.layers, strict=True):
        if isinstance(old, SlidingKVCache):
            layers.append(_sliding(old, new, before.length, length, cfg))  # type: ignore[arg-type]
        else:
            layers.append(_sparse(old, new, before.length, length, cfg))  # type: ignore[arg-type]
    return ModelCache(layers, length)


def _sliding(
    old: SlidingKVCache, new: SlidingKVCache, start: int, length: int, cfg: ModelConfig
) -> SlidingKVCache:
    assert new.start <= start, "the verify trimmed rows the rolled-back cache still needs"
    rows = slice(start - new.start, length - new.start)
    out = SlidingKVCache(old.k, old.v, old.start)
    out.append(new.k[rows], new.v[rows])
    out.trim_before(keep_from(cfg, length))
    return out


def _sparse(
    old: SparseKVCache, new: SparseKVCache, start: int, length: int, cfg: ModelConfig
) -> SparseKVCache:
    out = SparseKVCache(
        old.k, old.v, old.block_keys, old.pending_index_keys, old.last_block_index_keys
    )
    raw = _new_index_keys(old, new, cfg.sparse_block)
    out.append(new.k[start:length], new.v[start:length], raw[: length - start], cfg.sparse_block)
    return out


def _new_index_keys(old: SparseKVCache, new: SparseKVCache, block: int) -> Tensor:
    """Raw index keys of the rows `new` has beyond `old` (at most one block was completed)."""
    merged = new.block_keys.shape[0] - old.block_keys.shape[0]
    assert merged <= 1, "a verify chunk may complete at most one Sparse GQA block"
    tail = (
        torch.cat([new.last_block_index_keys, new.pending_index_keys])
        if merged
        else new.pending_index_keys
    )
    return tail[old.pending_index_keys.shape[0] :]
