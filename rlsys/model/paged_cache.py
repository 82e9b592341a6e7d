"""The engine's paged KV cache for the Triton path: page pools, block tables, sharing.

Legend: P tokens per page, B Sparse GQA block size (P % B == 0).
Invariants:
- Every layer of a kind uses the same page ids for a sequence (one block table per kind):
  Sparse GQA pages hold K/V, the tokens' index keys and the merged block keys of the page's
  P / B blocks; SWA pages hold K/V.
- Appending writes the new rows in place: a cache is never copied as a whole.
- SWA pages that no future query can see (all positions <= length - W - 1) are released as
  the sequence grows, so a sequence holds O(W / P) SWA pages.
- `fork` shares every full page (reference counts) and copies only the partially filled
  last page, so a fork and its origin append independently (the prefix cache's snapshots).
- A page returns to the free list when its last holder releases it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from rlsys.config.model import ModelConfig


class PagesExhausted(RuntimeError):
    """The pool has no free page left (the engine admitted more than fits)."""


class PageAllocator:
    """Free list + reference counts over page ids [0, n)."""

    def __init__(self, n: int) -> None:
        self.free = list(range(n - 1, -1, -1))
        self.refs = [0] * n

    def alloc(self) -> int:
        if not self.free:
            raise PagesExhausted(f"all {len(self.refs)} KV pages are in use")
        page = self.free.pop()
        self.refs[page] = 1
        return page

    def share(self, page: int) -> None:
        self.refs[page] += 1

    def release(self, page: int) -> None:
        self.refs[page] -= 1
        if self.refs[page] == 0:
            self.free.append(page)

    @property
    def in_use(self) -> int:
        return len(self.refs) - len(self.free)


@dataclass
class PagedSeqCache:
    """One sequence's pages; `length` tokens are cached. SWA entries below `swa_first` are
    released (None)."""

    length: int = 0
    sparse_pages: list[int] = field(default_factory=list)
    swa_pages: list[int | None] = field(default_factory=list)
    swa_released: int = 0  # SWA pages [0, swa_released) are released (None)


class PagePool:
    """All layers' pages on one device (see module doc)."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        page_size: int,
        sparse_pages: int,
        swa_pages: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        kinds = cfg.layer_kinds()
        hkv, hd, idx, b = cfg.n_kv_groups, cfg.head_dim, cfg.index_dim, cfg.sparse_block
        assert page_size % b == 0
        self.cfg, self.page_size, self.device = cfg, page_size, torch.device(device)
        n_sp, n_sw = kinds.count("sparse"), kinds.count("swa")
        rows_sp, rows_sw = sparse_pages * page_size, swa_pages * page_size

        def new(rows: int, *shape: int, dt: torch.dtype = dtype) -> Tensor:
            return torch.zeros(rows, *shape, dtype=dt, device=self.device)

        self.sparse_k = [new(rows_sp, hkv, hd) for _ in range(n_sp)]
        self.sparse_v = [new(rows_sp, hkv, hd) for _ in range(n_sp)]
        self.index_keys = [new(rows_sp, idx, dt=torch.float32) for _ in range(n_sp)]
        self.block_keys = [new(rows_sp // b, idx, dt=torch.float32) for _ in range(n_sp)]
        self.swa_k = [new(rows_sw, hkv, hd) for _ in range(n_sw)]
        self.swa_v = [new(rows_sw, hkv, hd) for _ in range(n_sw)]
        self.sparse_alloc = PageAllocator(sparse_pages if n_sp else 0)
        self.swa_alloc = PageAllocator(swa_pages if n_sw else 0)

    # ---- sequences ----------------------------------------------------------------------

    def reserve(self, cache: PagedSeqCache, new_length: int) -> None:
        """Allocate the pages positions [cache.length, new_length) will be written to."""
        need = -(-new_length // self.page_size)
        if self.sparse_k:
            while len(cache.sparse_pages) < need:
                cache.sparse_pages.append(self.sparse_alloc.alloc())
        if self.swa_k:
            while len(cache.swa_pages) < need:
                cache.swa_pages.append(self.swa_alloc.alloc())

    def trim_window(self, cache: PagedSeqCache) -> None:
        """Release SWA pages whose positions are all out of every future query's window."""
        if not self.swa_k:  # a model without SWA layers holds no SWA pages
            return
        keep_from = max(cache.length - self.cfg.swa_window, 0) // self.page_size
        for p in range(cache.swa_released, keep_from):  # only pages not released yet
            page = cache.swa_pages[p]
            if page is not None:
                self.swa_alloc.release(page)
                cache.swa_pages[p] = None
        cache.swa_released = max(cache.swa_released, keep_from)

    def fork(self, cache: PagedSeqCache) -> PagedSeqCache:
        """A snapshot sharing full pages; the partial last page is copied."""
        new = PagedSeqCache(
            cache.length, list(cache.sparse_pages), list(cache.swa_pages), cache.swa_released
        )
        for page in new.sparse_pages:
            self.sparse_alloc.share(page)
        for page in new.swa_pages:
            if page is not None:
                self.swa_alloc.share(page)
        if cache.length % self.page_size:
            last = cache.length // self.page_size
            if self.sparse_k:
                new.sparse_pages[last] = self._copy_sparse_page(cache.sparse_pages[last])
            if self.swa_k and new.swa_pages[last] is not None:
                new.swa_pages[last] = self._copy_swa_page(cache.swa_pages[last])  # type: ignore[arg-type]
        return new

    def free(self, cache: PagedSeqCache) -> None:
        for page in cache.sparse_pages:
            self.sparse_alloc.release(page)
        for page in cache.swa_pages:
            if page is not None:
                self.swa_alloc.release(page)
        cache.sparse_pages, cache.swa_pages, cache.length = [], [], 0
        cache.swa_released = 0

    # ---- copies ------------------------------------------------------------------------------

    def _copy_sparse_page(self, src: int) -> int:
        dst = self.sparse_alloc.alloc()
        self.sparse_alloc.release(src)
        p, b = self.page_size, self.cfg.sparse_block
        for pool in (*self.sparse_k, *self.sparse_v, *self.index_keys):
            pool[dst * p : (dst + 1) * p] = pool[src * p : (src + 1) * p]
        for pool in self.block_keys:
            pool[dst * p // b : (dst + 1) * p // b] = pool[src * p // b : (src + 1) * p // b]
        return dst

    def _copy_swa_page(self, src: int) -> int:
        dst = self.swa_alloc.alloc()
        self.swa_alloc.release(src)
        p = self.page_size
        for pool in (*self.swa_k, *self.swa_v):
            pool[dst * p : (dst + 1) * p] = pool[src * p : (src + 1) * p]
        return dst

    def nbytes(self) -> int:
        pools = [*self.sparse_k, *self.sparse_v, *self.index_keys, *self.block_keys]
        return sum(t.nbytes for t in pools + [*self.swa_k, *self.swa_v])
