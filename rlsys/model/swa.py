"""Gated sliding-window attention (GQA, window W, a sigmoid output gate per head).

A query at position t sees keys at positions (t - W, t]. Queries are processed in tiles of
`swa_tile` aligned positions; a tile reads a fixed set of aligned key blocks (its own and
the `swa_blocks_per_tile - 1` before it), so every kernel call has one shape whatever the
chunk length, and a query sits at the same row and reads the same blocks in a full forward
and in token-by-token decode (the basis of bitwise prefill/decode agreement).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from rlsys import kernels
from rlsys.config.model import ModelConfig
from rlsys.kernels import fused
from rlsys.model.attention import (
    AttentionProjections,
    SeqSpan,
    checkpointed,
    items_to_rows,
    rows_to_items,
)
from rlsys.model.aux import AuxLosses
from rlsys.model.cache import SlidingKVCache
from rlsys.model.kv_layout import TritonKV
from rlsys.model.routing import Routing


class GatedSlidingWindowAttention(nn.Module):
    """One SWA layer; `forward` serves full sequences and incremental chunks alike."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        self.proj = AttentionProjections(cfg, dtype)
        self.kind_index = 0  # among the model's SWA layers (its pools in a PagePool)

    def refresh_fused(self) -> None:
        """Bring the cached fused weights up to date (before a CUDA-graph replay)."""
        self.proj.refresh_fused()

    def new_cache(self, dtype: torch.dtype, device: torch.device) -> SlidingKVCache:
        cfg = self.cfg
        empty = torch.zeros(0, cfg.n_kv_groups, cfg.head_dim, dtype=dtype, device=device)
        return SlidingKVCache(k=empty, v=empty.clone())

    def forward(
        self,
        x: Tensor,
        positions: Tensor,
        spans: list[SeqSpan],
        caches: list[SlidingKVCache] | TritonKV,
        aux: AuxLosses | None = None,
        routing: Routing | None = None,  # unused: a window decides nothing (no replay)
    ) -> Tensor:
        if isinstance(caches, TritonKV) and caches.paged is not None and fused.fusable(x):
            from rlsys.model.triton_attention import swa_attention_fused

            gated = swa_attention_fused(self.cfg, self.kind_index, self.proj, x, positions, caches)
            return self.proj.output(gated)
        q, k, v, gate = self.proj.qkv(x, positions)
        if isinstance(caches, TritonKV):
            from rlsys.model.triton_attention import swa_attention

            out = swa_attention(self.cfg, self.kind_index, self.proj.scale, q, k, v, caches)
            return self.proj.gated_output(gate, out)
        # decode rows (one query per sequence) of a step without autograd: one call for all
        decode = [i for i, s in enumerate(spans) if s.n == 1] if not torch.is_grad_enabled() else []
        outs: list[Tensor | None] = [None] * len(spans)
        if len(decode) > 1:
            together = self._attend_decode(
                q, k, v, [spans[i] for i in decode], [caches[i] for i in decode]
            )
            for j, i in enumerate(decode):
                outs[i] = together[j : j + 1]
        for i, (s, cache) in enumerate(zip(spans, caches, strict=True)):
            if outs[i] is None:
                rows = slice(s.row, s.row + s.n)
                outs[i] = self._attend(q[rows], k[rows], v[rows], s.pos, cache)
        return self.proj.gated_output(gate, torch.cat(outs, dim=0))  # type: ignore[arg-type]

    def _attend_decode(
        self, q: Tensor, k: Tensor, v: Tensor, spans: list[SeqSpan], caches: list[SlidingKVCache]
    ) -> Tensor:
        """Decode rows (one query per sequence, in span order) -> (B, H, D): every
        sequence's tile in one `block_attention` call. Each item is the one `_attend` builds
        for that sequence alone (its query at its row of the tile, its window's key blocks,
        its visibility), and items do not see each other, so the bits are `_attend`'s."""
        cfg = self.cfg
        tile, u, hkv, d = cfg.swa_tile, cfg.swa_blocks_per_tile, cfg.n_kv_groups, cfg.head_dim
        b, dev = len(spans), q.device
        kbufs, vbufs = [], []
        for s, cache in zip(spans, caches, strict=True):
            cache.append(k[s.row : s.row + 1], v[s.row : s.row + 1])
            j = s.pos // tile
            base, end = (j - (u - 1)) * tile, (j + 1) * tile
            kbufs.append(_window(cache.k, cache.start, base, end))
            vbufs.append(_window(cache.v, cache.start, base, end))
            cache.trim_before(keep_from(cfg, s.pos + 1))

        def blocks(bufs: list[Tensor]) -> Tensor:  # (B * Hkv, U, tile, D)
            return (
                torch.stack(bufs)
                .view(b, u, tile, hkv, d)
                .permute(0, 3, 1, 2, 4)
                .reshape(b * hkv, u, tile, d)
            )

        pos = torch.tensor([s.pos for s in spans], device=dev)
        rows = torch.tensor([s.row for s in spans], device=dev)
        q_items = rows_to_items(q[rows], torch.arange(b, device=dev), pos % tile, b, tile, hkv)
        g = cfg.n_heads // hkv
        visible = self._visible(pos // tile, pos, pos + 1)
        vis = visible[:, None, :, None].expand(b, hkv, tile, g, u, tile)
        out, _ = kernels.block_attention(
            q_items, blocks(kbufs), blocks(vbufs), vis.reshape(b * hkv, tile * g, u, tile),
            self.proj.scale,
        )  # fmt: skip
        return items_to_rows(out, torch.arange(b, device=dev), pos % tile, b, tile, hkv)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, pos0: int, cache: SlidingKVCache) -> Tensor:
        cfg = self.cfg
        tile, n_back, step = cfg.swa_tile, cfg.swa_blocks_per_tile - 1, cfg.tiles_per_chunk
        n = q.shape[0]
        cache.append(k, v)
        j0, j1 = pos0 // tile, (pos0 + n - 1) // tile
        base, end = (j0 - n_back) * tile, (j1 + 1) * tile
        kbuf = _window(cache.k, cache.start, base, end)
        vbuf = _window(cache.v, cache.start, base, end)
        outs = []
        for ja in range(j0, j1 + 1, step):
            lo, hi = max(pos0, ja * tile), min(pos0 + n, (ja + step) * tile)
            # keys of tiles ja.. start at block ja - n_back, i.e. buffer row (ja - j0) * tile
            keys = slice((ja - j0) * tile, (min(ja + step, j1 + 1) - j0 + n_back) * tile)
            outs.append(
                checkpointed(
                    self._attend_tiles, q[lo - pos0 : hi - pos0], kbuf[keys], vbuf[keys], lo, ja
                )
            )
        cache.trim_before(keep_from(cfg, pos0 + n))
        return torch.cat(outs, dim=0)

    def _attend_tiles(
        self, q: Tensor, kbuf: Tensor, vbuf: Tensor, lo: int, first_tile: int
    ) -> Tensor:
        """Queries at [lo, lo + m) in tiles >= first_tile; kbuf starts at its first key block."""
        cfg = self.cfg
        tile, u, hkv, d = cfg.swa_tile, cfg.swa_blocks_per_tile, cfg.n_kv_groups, cfg.head_dim
        m, dev = q.shape[0], q.device
        rel = torch.arange(m, device=dev) + lo - first_tile * tile
        tile_of_row, offset = rel // tile, rel % tile
        n_tiles = int(tile_of_row[-1]) + 1
        block_ids = torch.arange(n_tiles, device=dev)[:, None] + torch.arange(u, device=dev)
        kb = kbuf.view(-1, tile, hkv, d)[block_ids].permute(0, 3, 1, 2, 4).reshape(-1, u, tile, d)
        vb = vbuf.view(-1, tile, hkv, d)[block_ids].permute(0, 3, 1, 2, 4).reshape(-1, u, tile, d)
        q_items = rows_to_items(q, tile_of_row, offset, n_tiles, tile, hkv)
        g = cfg.n_heads // hkv
        visible = self._visible(first_tile + torch.arange(n_tiles, device=dev), lo, lo + m)
        vis = visible[:, None, :, None].expand(n_tiles, hkv, tile, g, u, tile)
        out, _ = kernels.block_attention(
            q_items, kb, vb, vis.reshape(n_tiles * hkv, tile * g, u, tile), self.proj.scale
        )
        return items_to_rows(out, tile_of_row, offset, n_tiles, tile, hkv)

    def _visible(self, tiles: Tensor, lo: Tensor | int, hi: Tensor | int) -> Tensor:
        """(tiles, Tq, U, S) bool for query tiles `tiles` (absolute tile indices) and their
        key blocks: key within (t - W, t], key >= 0, query in [lo, hi) (per tile, or one
        range for all)."""
        cfg = self.cfg
        tile, u = cfg.swa_tile, cfg.swa_blocks_per_tile
        ar = torch.arange(tile, device=tiles.device)
        qpos = tiles[:, None] * tile + ar[None, :]  # (tiles, Tq)
        blocks = (tiles - (u - 1))[:, None] + torch.arange(u, device=tiles.device)  # (tiles, U)
        kpos = (blocks * tile)[..., None] + ar  # (tiles, U, S)
        qp, kp = qpos[:, :, None, None], kpos[:, None, :, :]
        if isinstance(lo, Tensor):
            lo, hi = lo[:, None, None, None], hi[:, None, None, None]  # type: ignore[index]
        present = (qp >= lo) & (qp < hi)
        return (kp <= qp) & (kp > qp - cfg.swa_window) & (kp >= 0) & present


def keep_from(cfg: ModelConfig, length: int) -> int:
    """The first position a cache of `length` tokens keeps: the next query's key blocks."""
    return (length // cfg.swa_tile - (cfg.swa_blocks_per_tile - 1)) * cfg.swa_tile


def _window(store: Tensor, start: int, base: int, end: int) -> Tensor:
    """Positions [base, end) of a token-major store holding [start, start + len); zeros outside."""
    lo, hi = max(start, base), min(start + store.shape[0], end)
    rest = store.shape[1:]
    before = store.new_zeros(lo - base, *rest)
    after = store.new_zeros(end - max(hi, lo), *rest)
    return torch.cat([before, store[lo - start : max(hi, lo) - start], after], dim=0)
