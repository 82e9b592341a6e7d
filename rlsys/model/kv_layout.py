"""Where a forward's keys live on the Triton path, built once per forward (torch only).

- packed (the trainer): K/V are the freshly projected tensors of sequences packed from
  position 0, addressed through a contiguous block table; nothing is copied;
- paged (the engine): this call's tokens get pages in the `PagePool` (reserved here) and
  their pool rows, and every sequence's block table is laid out for the kernels.
`KernelGeometry` holds the kernels' constant tile shapes, derived from the model config
only, so engine and trainer run the same reductions. Importing this module does not import
triton (the model's reference path uses `TritonKV` only as a type to dispatch on).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rlsys.config.model import ModelConfig
from rlsys.kernels.attention_plan import PagedKV, QueryTiles, Span, contiguous_table, plan_tiles
from rlsys.model.attention import SeqSpan
from rlsys.model.paged_cache import PagedSeqCache, PagePool

MMA_ROWS = 64  # query-tile rows (slots x heads of a group) of every attention program


@dataclass(frozen=True)
class KernelGeometry:
    """Constant tile shapes of the attention kernels, derived from the model config only."""

    query_tile: int  # T slots: T * heads-per-group = MMA_ROWS
    swa_step: int
    sparse_step: int
    page_size: int


def geometry(cfg: ModelConfig) -> KernelGeometry:
    g = cfg.n_heads // cfg.n_kv_groups
    if MMA_ROWS % g:
        raise ValueError(f"heads per KV group ({g}) must divide {MMA_ROWS} for the Triton kernels")
    b = cfg.sparse_block
    if b & (b - 1):
        raise ValueError(f"sparse_block ({b}) must be a power of two for the Triton kernels")
    sparse_step = max(16, b)
    return KernelGeometry(MMA_ROWS // g, 32, sparse_step, max(64, sparse_step))


@dataclass
class PackedLayout:
    seq_lens: list[int]
    kv: PagedKV  # over the packed K/V rows
    bk: PagedKV  # over the packed block keys
    block_counts: list[int]  # complete blocks per sequence
    rows: list[tuple[int, int]]  # (first row, length) per sequence


@dataclass
class PagedLayout:
    pool: PagePool
    sparse_kv: PagedKV
    swa_kv: PagedKV
    bk: PagedKV
    sparse_rows: Tensor  # (N,) pool rows of the new tokens
    swa_rows: Tensor
    block_token_rows: Tensor  # (n_done, B) index-key rows of blocks completed by this call
    block_rows: Tensor  # (n_done,) their block-key rows
    # one entry per query row (a decode step's fixed layout: rows that complete no block
    # address a scratch block), so the projection epilogue can merge the keys itself
    blocks_by_row: bool = False


@dataclass
class TritonKV:
    geo: KernelGeometry
    tiles: QueryTiles
    packed: PackedLayout | None = None
    paged: PagedLayout | None = None


def packed_kv(cfg: ModelConfig, spans: list[SeqSpan], device: torch.device) -> TritonKV:
    """Training: sequences at rows spans[i], each from position 0."""
    geo = geometry(cfg)
    lens = [s.n for s in spans]
    tiles = plan_tiles(
        [Span(i, s.row, s.n, 0) for i, s in enumerate(spans)], geo.query_tile, device
    )
    counts = [n // cfg.sparse_block for n in lens]
    bpp = geo.page_size // cfg.sparse_block
    layout = PackedLayout(
        lens,
        contiguous_table(lens, geo.page_size, device),
        contiguous_table([max(c, 1) for c in counts], bpp, device),
        counts,
        [(s.row, s.n) for s in spans],
    )
    return TritonKV(geo, tiles, packed=layout)


def paged_kv(
    cfg: ModelConfig, pool: PagePool, spans: list[SeqSpan], caches: list[PagedSeqCache]
) -> TritonKV:
    """Engine: reserve pages for this call's tokens and lay out every address it needs."""
    geo = geometry(cfg)
    p, b, dev = pool.page_size, cfg.sparse_block, pool.device
    tiles = plan_tiles(
        [Span(i, s.row, s.n, s.pos) for i, s in enumerate(spans)], geo.query_tile, dev
    )
    sparse_rows, swa_rows, tok_rows, blk_rows = [], [], [], []
    for span, cache in zip(spans, caches, strict=True):
        pool.reserve(cache, span.pos + span.n)
        pos = torch.arange(span.pos, span.pos + span.n)
        if pool.sparse_k:
            pages = torch.tensor(cache.sparse_pages, dtype=torch.int64)
            sparse_rows.append(pages[pos // p] * p + pos % p)
            done = torch.arange(span.pos // b, (span.pos + span.n) // b)  # blocks completed now
            tok = done[:, None] * b + torch.arange(b)[None, :]
            tok_rows.append(pages[tok // p] * p + tok % p)
            blk_rows.append(pages[done * b // p] * (p // b) + done % (p // b))
        if pool.swa_k:
            pages = torch.tensor([x if x is not None else 0 for x in cache.swa_pages])
            swa_rows.append(pages[pos // p] * p + pos % p)

    def cat(parts: list[Tensor], *shape: int) -> Tensor:
        t = torch.cat(parts) if parts else torch.zeros(0, *shape, dtype=torch.int64)
        return t.to(dev)

    sparse_tab = _table([c.sparse_pages for c in caches], p, dev)
    layout = PagedLayout(
        pool,
        sparse_tab,
        _table([[x if x is not None else 0 for x in c.swa_pages] for c in caches], p, dev),
        PagedKV(sparse_tab.block_table // b, p // b),
        cat(sparse_rows),
        cat(swa_rows),
        cat(tok_rows, b),
        cat(blk_rows),
    )
    return TritonKV(geo, tiles, paged=layout)


def _table(pages: list[list[int]], page_size: int, device: torch.device) -> PagedKV:
    width = max(1, max(len(x) for x in pages))
    rows = [[q * page_size for q in x] + [0] * (width - len(x)) for x in pages]
    return PagedKV(torch.tensor(rows, dtype=torch.int32, device=device), page_size)
