"""`StaticDecodeLayout.fill` keeps its host page tables between steps and rewrites only the
rows whose sequence or pages changed: every step's buffers must be exactly those a fresh
layout (which writes every row) gives for the same step."""

from __future__ import annotations

import pytest
import torch

from rlsys.config.model import preset
from rlsys.model.decode_layout import StaticDecodeLayout, scratch_pages
from rlsys.model.paged_cache import PagedSeqCache, PagePool

pytestmark = pytest.mark.unit


def _buffers(layout: StaticDecodeLayout) -> tuple[list[int], list[int]]:
    return layout._dev64.tolist(), layout._dev32.tolist()


@pytest.mark.parametrize("swa_per_sparse", [3, 0])
def test_kept_page_tables_give_a_fresh_layouts_buffers_at_every_step(swa_per_sparse: int) -> None:
    """Sequences grow across pages (a new page every 4 tokens), release SWA pages behind
    their window, are recomputed in new pages of the same count (a weight update), leave
    from the middle of the batch, are freed and come back empty, join, and a fork takes a
    finished one's place; with and without SWA layers."""
    cfg = preset("tiny").with_overrides({"swa_window": 6, "swa_per_sparse": swa_per_sparse})
    pool = PagePool(cfg, page_size=4, sparse_pages=96, swa_pages=96, dtype=torch.float32,
                    device="cpu")  # fmt: skip
    scratch = scratch_pages(pool)
    batch, max_pos = 6, 63
    kept = StaticDecodeLayout(cfg, pool, batch, max_pos, scratch)
    caches = [PagedSeqCache(length=n) for n in (0, 3, 5, 9)]
    for c in caches:
        pool.reserve(c, c.length)
    rewrites = rows_filled = 0
    for step in range(40):
        if step == 2:  # recomputed: the same page count in other pages, nothing released yet
            first, length = caches[0], caches[0].length
            pool.free(first)
            pool.reserve(PagedSeqCache(), 8)  # takes the pages just freed
            first.length = length
            pool.reserve(first, length)
        if step == 7:  # one leaves from the middle
            pool.free(caches.pop(1))
        if step == 12:  # the freed one's object comes back empty, at another row
            back = caches.pop(0)
            pool.free(back)
            caches.append(back)
        if step == 15:  # one joins
            caches.insert(0, PagedSeqCache())
        if step == 20:  # a fork (shared full pages, a copied partial page) replaces one
            caches[2] = pool.fork(caches[1])
        if step == 30:  # the batch shrinks to one
            caches = caches[-1:]
        tokens = [step + i for i in range(len(caches))]
        held = list(kept._held)
        kept.fill(tokens, caches)
        rows_filled += len(caches)
        rewrites += sum(a is not b for a, b in zip(held, kept._held, strict=True))
        fresh = StaticDecodeLayout(cfg, pool, batch, max_pos, scratch)
        fresh.fill(tokens, caches)
        assert _buffers(kept) == _buffers(fresh), f"step {step}"
        kept.advance(caches)
    # the point of keeping them: a row is rewritten only when its pages change (here about
    # every other step: 4-token pages, and an SWA page released every 4 tokens)
    assert rewrites < 0.6 * rows_filled, (rewrites, rows_filled)
