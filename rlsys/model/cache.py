"""Per-sequence inference caches, one object per attention layer, plus the model-level holder.

Invariants:
- `SlidingKVCache` keeps K/V of positions [start, start + len) and never more than the
  window's key blocks plus one tile (`ModelConfig.swa_blocks_per_tile * swa_tile`).
- `SparseKVCache` keeps full K/V of every position, fp32 block index keys of every complete
  block of B positions, and the index keys of the incomplete block (fewer than B).
- Tensors are token-major: K/V (L, n_kv_groups, head_dim), index keys (n, index_dim).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class SlidingKVCache:
    """Window-bounded K/V of a gated SWA layer for one sequence."""

    k: Tensor
    v: Tensor
    start: int = 0

    @property
    def end(self) -> int:
        return self.start + self.k.shape[0]

    def append(self, k_new: Tensor, v_new: Tensor) -> None:
        self.k = torch.cat([self.k, k_new], dim=0)
        self.v = torch.cat([self.v, v_new], dim=0)

    def trim_before(self, position: int) -> None:
        """Drop positions < `position` (keeps the cache window-bounded)."""
        drop = min(max(position - self.start, 0), self.k.shape[0])
        if drop:
            self.k, self.v, self.start = self.k[drop:], self.v[drop:], self.start + drop

    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


@dataclass
class SparseKVCache:
    """Full K/V plus block index keys of a Sparse GQA layer for one sequence."""

    k: Tensor
    v: Tensor
    block_keys: Tensor
    pending_index_keys: Tensor

    @property
    def length(self) -> int:
        return self.k.shape[0]

    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.k, self.v, self.block_keys, self.pending_index_keys))


LayerCache = SlidingKVCache | SparseKVCache


@dataclass
class ModelCache:
    """All layers' caches of one sequence; `length` tokens have been processed."""

    layers: list[LayerCache] = field(default_factory=list)
    length: int = 0

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)
