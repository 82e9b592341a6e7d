"""A decode step's addresses in buffers of fixed shape, for CUDA-graph replay (torch, numpy).

`paged_kv` (rlsys.model.kv_layout) lays out each step's addresses in tensors sized by that
step: fine eagerly, impossible to replay as a CUDA graph, whose every tensor has one address
and one shape. `StaticDecodeLayout` holds the same addresses for a decode step of up to
`batch` sequences (one new token each) in buffers allocated once; `fill` rewrites them from
the host with two host->device copies, and the forward reads them through a `TritonKV`
whose tensors are those buffers.

Invariants:
- Every address is what `paged_kv` computes for the same step, so a real row's output is
  bitwise the eager decode's (the kernels are functions of each row's own addresses).
- The kernels' sizes are fixed by (`batch`, `max_pos`), never by the step: `max_pos` is the
  bucket's last position, not the batch's largest. The indexer then scores more (masked)
  blocks and the union walks more (empty) bitmap words; the selected set, and so every
  output, is the same (the selection is exact and tie-broken by block id).
- Rows beyond the step's sequences (padding up to `batch`) and the block-key update of
  sequences that complete no block this step address one scratch page of each kind, which
  no sequence owns: whatever they compute is written there and never read by a real row.
Legend: B batch (graph size), P page tokens, K Sparse GQA block, MP pages per table row.
"""

from __future__ import annotations

import array
from typing import NamedTuple

import numpy as np
import torch

from rlsys.config.model import ModelConfig
from rlsys.kernels.attention_plan import PagedKV, QueryTiles
from rlsys.kernels.host_to_device import CopyFence
from rlsys.model.kv_layout import PagedLayout, TritonKV, geometry
from rlsys.model.paged_cache import PagedSeqCache, PagePool


class StaticDecodeLayout:
    """Fixed-shape buffers of a decode step of up to `batch` sequences (see module doc)."""

    def __init__(
        self, cfg: ModelConfig, pool: PagePool, batch: int, max_pos: int, scratch: tuple[int, int]
    ) -> None:
        self.cfg, self.pool, self.batch, self.max_pos = cfg, pool, batch, max_pos
        self.scratch_sparse, self.scratch_swa = scratch
        geo = geometry(cfg)
        p, k, dev = pool.page_size, cfg.sparse_block, pool.device
        self.pages = max_pos // p + 1  # MP: table width that reaches position max_pos
        # int64 host fields: tokens, positions, sparse rows, swa rows, block rows, K token rows
        self._n64 = (5 + k) * batch
        # int32 host fields: slot0, lo, hi, q_pos, sparse table, bk table, swa table
        self._n32 = 4 * batch + 3 * batch * self.pages
        pin = dev.type == "cuda"
        self._host64 = torch.zeros(self._n64, dtype=torch.int64, pin_memory=pin)
        self._host32 = torch.zeros(self._n32, dtype=torch.int32, pin_memory=pin)
        self._dev64 = torch.zeros(self._n64, dtype=torch.int64, device=dev)
        self._dev32 = torch.zeros(self._n32, dtype=torch.int32, device=dev)
        # the next fill rewrites the pinned buffers once the device has read them (a step
        # queued ahead may not have started)
        self._copied = CopyFence(pin)
        b64, b32 = self._dev64, self._dev32
        self.tokens, self.positions = b64[:batch], b64[batch : 2 * batch]
        sparse_rows, swa_rows = b64[2 * batch : 3 * batch], b64[3 * batch : 4 * batch]
        block_rows = b64[4 * batch : 5 * batch]
        block_token_rows = b64[5 * batch :].view(batch, k)
        slot0, lo, hi, q_pos = (b32[i * batch : (i + 1) * batch] for i in range(4))
        tables = b32[4 * batch :].view(3, batch, self.pages)
        ids = torch.arange(batch, dtype=torch.int32, device=dev)  # one tile per sequence
        tiles = QueryTiles(
            geo.query_tile, ids, slot0, lo, hi, ids, ids, q_pos,
            max_pos=max_pos, host_row=tuple(range(batch)), host_rows=(1,) * batch,
        )  # fmt: skip
        layout = PagedLayout(
            pool,
            PagedKV(tables[0], p),
            PagedKV(tables[2], p),
            PagedKV(tables[1], p // k),
            sparse_rows,
            swa_rows,
            block_token_rows,
            block_rows,
            blocks_by_row=True,
        )
        self.kv = TritonKV(geo, tiles, paged=layout)
        # The page tables on the host, kept between steps in the pinned int32 buffer itself,
        # already scaled to the rows the kernels read (sparse page x P, sparse page x P / K,
        # SWA page x P): a row is rewritten only when its sequence or that sequence's pages
        # changed since the last fill (`_holds`), so a step costs O(batch) compares and
        # O(batch) array ops, not O(batch x pages) copies. numpy views of the pinned buffers:
        # a step's dozen small array ops cost ~1 us each, torch's ~10.
        self._h64 = self._host64.numpy()
        self._h32 = self._host32.numpy()
        self._tabs = self._h32[4 * batch :].reshape(3, batch, self.pages)
        self._tabs[0] = self.scratch_sparse * p
        self._tabs[1] = self.scratch_sparse * (p // k)
        self._tabs[2] = self.scratch_swa * p
        self._rows = np.arange(batch)
        self._in_block = np.arange(k)
        self._held: list[_PagesHeld | None] = [None] * batch  # None: padding

    def _write_rows(self, rows: list[int], caches: list[PagedSeqCache | None]) -> None:
        """Rewrite host table rows `rows` from `caches` (None: a padding row), in one
        indexed assignment per table: the rows of a batch that started together change in
        the same step (a page boundary). Call with the pinned buffers free (`_copied`)."""
        mp, p, k = self.pages, self.pool.page_size, self.cfg.sparse_block
        sp_pad, sw_pad = [self.scratch_sparse] * mp, [self.scratch_swa] * mp
        # flat int64 arrays: a C loop per row (a nested list's conversion is ~2x slower)
        sparse_flat, swa_flat = array.array("q"), array.array("q")
        for i, cache in zip(rows, caches, strict=True):
            if cache is None:
                sparse_flat.extend(sp_pad)
                swa_flat.extend(sw_pad)
                self._held[i] = None
                continue
            sp = cache.sparse_pages if self.pool.sparse_k else []
            sparse_flat.extend(sp)
            sparse_flat.extend(sp_pad[len(sp) :])
            sw = [x if x is not None else 0 for x in cache.swa_pages] if self.pool.swa_k else []
            swa_flat.extend(sw)
            swa_flat.extend(sw_pad[len(sw) :])
            self._held[i] = _PagesHeld(
                cache.sparse_pages, len(cache.sparse_pages), cache.swa_pages,
                len(cache.swa_pages), cache.swa_released,
            )  # fmt: skip
        index = np.asarray(rows)
        sparse = np.frombuffer(sparse_flat, dtype=np.int64).reshape(-1, mp)
        self._tabs[0][index] = sparse * p
        self._tabs[1][index] = sparse * (p // k)
        self._tabs[2][index] = np.frombuffer(swa_flat, dtype=np.int64).reshape(-1, mp) * p

    def _update_rows(self, rows: list[int], caches: list[PagedSeqCache | None]) -> None:
        """Bring stale rows up to date: a row that still holds its sequence's page lists
        (the same list objects: they only grew, and released SWA pages below
        `swa_released`) gets only the entries that changed, all such rows in one indexed
        assignment per table; any other row (a new sequence, freed, forked, padding) is
        rewritten whole (`_write_rows`). A batch that started together crosses a page
        boundary in the same step: this keeps that step O(batch), not O(batch x pages)."""
        whole_rows: list[int] = []
        whole_caches: list[PagedSeqCache | None] = []
        sp_at: tuple[list[int], list[int], list[int]] = ([], [], [])  # row, column, page
        sw_at: tuple[list[int], list[int], list[int]] = ([], [], [])
        for i, cache in zip(rows, caches, strict=True):
            h = self._held[i]
            if (
                cache is None
                or h is None
                or h.sparse is not cache.sparse_pages
                or h.swa is not cache.swa_pages
            ):
                whole_rows.append(i)
                whole_caches.append(cache)
                continue
            if self.pool.sparse_k:
                for j in range(h.n_sparse, len(cache.sparse_pages)):
                    sp_at[0].append(i)
                    sp_at[1].append(j)
                    sp_at[2].append(cache.sparse_pages[j])
            if self.pool.swa_k:
                # released below the new mark (None: 0, as `_write_rows` writes), then new
                for j in (
                    *range(h.swa_released, cache.swa_released),
                    *range(h.n_swa, len(cache.swa_pages)),
                ):
                    sw_at[0].append(i)
                    sw_at[1].append(j)
                    sw_at[2].append(cache.swa_pages[j] or 0)
            self._held[i] = _PagesHeld(
                cache.sparse_pages, len(cache.sparse_pages), cache.swa_pages,
                len(cache.swa_pages), cache.swa_released,
            )  # fmt: skip
        if whole_rows:
            self._write_rows(whole_rows, whole_caches)
        p, k = self.pool.page_size, self.cfg.sparse_block
        if sp_at[0]:
            at, pages = (np.asarray(sp_at[0]), np.asarray(sp_at[1])), np.asarray(sp_at[2])
            self._tabs[0][at] = pages * p
            self._tabs[1][at] = pages * (p // k)
        if sw_at[0]:
            self._tabs[2][np.asarray(sw_at[0]), np.asarray(sw_at[1])] = np.asarray(sw_at[2]) * p

    def fill(self, tokens: list[int], caches: list[PagedSeqCache]) -> None:
        """Reserve pages for each sequence's next token and write the step's addresses."""
        n, bsz = len(tokens), self.batch
        assert n <= bsz and len(caches) == n  # n = 0: padding only (warm-up and capture)
        p, k, geo_t = self.pool.page_size, self.cfg.sparse_block, self.kv.geo.query_tile
        pos = np.zeros(bsz, dtype=np.int64)
        held = self._held
        stale: list[int] = []  # rows whose held pages are not their sequence's now
        for i, cache in enumerate(caches):
            assert cache.length <= self.max_pos, "the sequence outgrew this graph's bucket"
            self.pool.reserve(cache, cache.length + 1)
            pos[i] = cache.length
            if not _holds(held[i], cache):
                stale.append(i)
        stale += [i for i in range(n, bsz) if held[i] is not None]
        self._copied.wait()
        if stale:
            self._update_rows(stale, [caches[i] if i < n else None for i in stale])
        tabs, rows = self._tabs, self._rows
        page, in_page = pos // p, pos % p
        sparse_at = tabs[0][rows, page]  # this position's sparse page x P
        completes = (pos + 1) % k == 0
        completes[n:] = False
        # the block a completing token closes (a block never straddles a page), else the
        # scratch page's first block
        block_in_page = np.where(completes, in_page // k, 0)
        block_page = np.where(completes, tabs[1][rows, page], self.scratch_sparse * (p // k))
        token_base = np.where(completes, sparse_at, self.scratch_sparse * p) + block_in_page * k
        h64 = self._h64
        h64[:bsz] = 0
        h64[:n] = tokens
        h64[bsz : 2 * bsz] = pos
        h64[2 * bsz : 3 * bsz] = sparse_at + in_page
        h64[3 * bsz : 4 * bsz] = tabs[2][rows, page] + in_page
        h64[4 * bsz : 5 * bsz] = block_page + block_in_page
        h64[5 * bsz :] = (token_base[:, None] + self._in_block[None, :]).reshape(-1)
        h32 = self._h32
        h32[:bsz] = pos // geo_t * geo_t
        h32[bsz : 2 * bsz] = pos
        h32[2 * bsz : 3 * bsz] = pos + 1
        h32[3 * bsz : 4 * bsz] = pos
        self._dev64.copy_(self._host64, non_blocking=True)
        self._dev32.copy_(self._host32, non_blocking=True)
        self._copied.mark()

    def advance(self, caches: list[PagedSeqCache]) -> None:
        """After the forward: each sequence holds one more token; release out-of-window pages."""
        for cache in caches:
            cache.length += 1
            self.pool.trim_window(cache)


class _PagesHeld(NamedTuple):
    """What a host table row was written from: a cache's page lists and their state.

    A row still holds a cache's pages while this matches it (`_holds`): a cache's page
    lists only grow (`reserve`) and release SWA pages below `swa_released` (`trim_window`);
    `free` gives the cache new lists, and a fork copies them, so no two caches share a list.
    The lists are compared by identity, and held (an id is never reused while a row refers
    to it)."""

    sparse: list[int]
    n_sparse: int
    swa: list[int | None]
    n_swa: int
    swa_released: int


def _holds(held: _PagesHeld | None, cache: PagedSeqCache) -> bool:
    return (
        held is not None
        and held.sparse is cache.sparse_pages
        and held.n_sparse == len(cache.sparse_pages)
        and held.swa is cache.swa_pages
        and held.n_swa == len(cache.swa_pages)
        and held.swa_released == cache.swa_released
    )


def scratch_pages(pool: PagePool) -> tuple[int, int]:
    """One page of each kind that no sequence will own (padding rows write there)."""
    sparse = pool.sparse_alloc.alloc() if pool.sparse_k else 0
    swa = pool.swa_alloc.alloc() if pool.swa_k else 0
    return sparse, swa
