"""Per-sequence inference caches, one object per attention layer, plus the model-level holder.

Invariants:
- `SlidingKVCache` keeps K/V of positions [start, start + len) and never more than the
  window's key blocks plus one tile (`ModelConfig.swa_blocks_per_tile * swa_tile`).
- `SparseKVCache` keeps full K/V of every position, fp32 block index keys of every complete
  block of B positions, the index keys of the incomplete block (fewer than B), and the raw
  index keys of the last complete block (so a speculative verify can be rolled back across
  one block boundary: `rlsys.model.cache_rollback`).
- Tensors are token-major: K/V (L, n_kv_groups, head_dim), index keys (n, index_dim).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from rlsys import kernels


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
    last_block_index_keys: Tensor

    @property
    def length(self) -> int:
        return self.k.shape[0]

    def append(self, k_new: Tensor, v_new: Tensor, index_keys: Tensor, block: int) -> None:
        """Append rows; every block of `block` positions completed here is merged (mean)."""
        self.k = torch.cat([self.k, k_new], dim=0)
        self.v = torch.cat([self.v, v_new], dim=0)
        pending = torch.cat([self.pending_index_keys, index_keys], dim=0)
        n_full = pending.shape[0] // block
        if n_full:
            full = pending[: n_full * block].view(n_full, block, -1)
            # In-order fold so a block key is the same whether merged in prefill or decode.
            merged = kernels.sequential_sum(full, dim=1) / block
            self.block_keys = torch.cat([self.block_keys, merged], dim=0)
            self.last_block_index_keys = full[-1]
        self.pending_index_keys = pending[n_full * block :]

    def nbytes(self) -> int:
        parts = (self.k, self.v, self.block_keys, self.pending_index_keys)
        return sum(t.nbytes for t in parts) + self.last_block_index_keys.nbytes


LayerCache = SlidingKVCache | SparseKVCache


@dataclass
class ModelCache:
    """All layers' caches of one sequence; `length` tokens have been processed."""

    layers: list[LayerCache] = field(default_factory=list)
    length: int = 0

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)
