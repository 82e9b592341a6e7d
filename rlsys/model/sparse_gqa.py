"""Sparse GQA: block-merged index keys, per-KV-group top-k block selection, union tiles.

Per layer and sequence:
- Index keys (shared by all KV groups, fp32, rotary at their positions) of B adjacent
  positions are merged (mean) into one block key once the block is complete. Each KV group g has its own index query; a
  query at t scores every complete past block b < t // B and keeps the top k / B.
- Main attention reads the original K/V of the selected blocks plus the causally visible
  positions of the query's own (current) block.
- Queries are processed in aligned tiles of `sparse_query_tile` positions: a tile attends
  over the union of its queries' blocks, each query masked to its own. The fold over blocks
  is sequential and in ascending block order (`kernels.block_attention`), so the union adds
  exact zeros only and the result is bitwise the per-query result.
- Memory: per chunk of `tiles_per_chunk` tiles, O(chunk * union * B); index scores
  are over L / B blocks. No L x L tensor is built.
- Training: an indexer KL (DSA-style) pulls the index distribution over the selected blocks
  toward the main attention's (detached) mass on them; collected in `AuxLosses`.
- Selection record/replay (reference path): a `RoutingRecorder(blocks=True)` gets each
  row's selected block ids (N, Hkv, W) (ascending, -1 padded); a `RoutingReplay` with
  `blocks=True` makes the recorded rows attend to their recorded blocks instead of the
  indexer's top-k (the index scores are still computed, for the indexer KL). With the
  recorded weights this is bitwise the recorded forward: the same mask reaches the same
  fold. The Triton path neither records nor replays selections (it raises).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rlsys import kernels
from rlsys.config.model import ModelConfig
from rlsys.kernels import fused
from rlsys.model.attention import (
    FUSED_ALIGN,
    AttentionProjections,
    SeqSpan,
    checkpointed,
    init_weight,
    items_to_rows,
    rows_to_items,
)
from rlsys.model.aux import AuxLosses
from rlsys.model.cache import SparseKVCache
from rlsys.model.fused_weights import FusedWeight, fused_partials, fused_product
from rlsys.model.kv_layout import TritonKV
from rlsys.model.rope import apply_rope
from rlsys.model.routing import Routing, RoutingRecorder, RoutingReplay, cat_blocks


class SparseGQA(nn.Module):
    """One Sparse GQA layer; `forward` serves full sequences and incremental chunks alike."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        self.proj = AttentionProjections(cfg, dtype)
        self.w_index_q = init_weight(
            (cfg.n_kv_groups * cfg.index_dim, cfg.d_model), cfg.init_std, dtype
        )
        self.w_index_k = init_weight((cfg.index_dim, cfg.d_model), cfg.init_std, dtype)
        self.kind_index = 0  # among the model's Sparse GQA layers (its pools in a PagePool)
        self._fused_index = FusedWeight(FUSED_ALIGN)

    def index_product(self, x: Tensor) -> tuple[Tensor, list[int]]:
        """`x @ [w_index_q; w_index_k].T` (N, Ni), one product, and each part's first
        column. The indexer reads a detached input: its KL trains the index weights only
        (as in DSA), never the backbone; selection itself is discrete and passes no gradient."""
        return fused_product(x.detach(), [self.w_index_q, self.w_index_k], self._fused_index)

    def refresh_fused(self) -> None:
        """Bring the cached fused weights up to date (before a CUDA-graph replay)."""
        self.proj.refresh_fused()
        self._fused_index.refresh([self.w_index_q, self.w_index_k])

    def new_cache(self, dtype: torch.dtype, device: torch.device) -> SparseKVCache:
        cfg = self.cfg
        kv = torch.zeros(0, cfg.n_kv_groups, cfg.head_dim, dtype=dtype, device=device)
        idx = torch.zeros(0, cfg.index_dim, dtype=torch.float32, device=device)
        return SparseKVCache(
            k=kv,
            v=kv.clone(),
            block_keys=idx,
            pending_index_keys=idx.clone(),
            last_block_index_keys=idx.clone(),
        )

    def forward(
        self,
        x: Tensor,
        positions: Tensor,
        spans: list[SeqSpan],
        caches: list[SparseKVCache] | TritonKV,
        aux: AuxLosses | None = None,
        routing: Routing | None = None,
    ) -> Tensor:
        cfg = self.cfg
        n = x.shape[0]
        if (
            isinstance(caches, TritonKV)
            and caches.paged is not None
            and fused.fusable(x)
            and not (isinstance(routing, RoutingReplay | RoutingRecorder) and routing.blocks)
        ):
            from rlsys.model.triton_attention import sparse_attention_fused

            yi, offsets = fused_partials(x, [self.w_index_q, self.w_index_k], self._fused_index)
            gated = sparse_attention_fused(
                cfg, self.kind_index, self.proj, yi, offsets, x, positions, caches
            )
            return self.proj.output(gated)
        q, k, v, gate = self.proj.qkv(x, positions)
        # Rotary on index queries/keys (keys rotated per position, then merged) lets the
        # indexer learn relative-position preferences such as recency, not content alone.
        yi, (oq, ok) = self.index_product(x)
        hkv, idx = cfg.n_kv_groups, cfg.index_dim
        qi = yi[:, oq : oq + hkv * idx].float().reshape(n, hkv, idx)
        qi = apply_rope(qi, positions, cfg.rope_theta)
        ki = yi[:, ok : ok + idx].float().reshape(n, 1, idx)
        ki = apply_rope(ki, positions, cfg.rope_theta).view(n, -1)
        forced = (
            routing.lookup_blocks(self.kind_index) if isinstance(routing, RoutingReplay) else None
        )
        record = isinstance(routing, RoutingRecorder) and routing.blocks
        if isinstance(caches, TritonKV):
            if forced is not None or record:
                raise NotImplementedError("Sparse GQA selection record/replay: reference path only")
            from rlsys.model.triton_attention import sparse_attention

            want_kl = aux is not None and torch.is_grad_enabled()
            out, kl = sparse_attention(
                cfg, self.kind_index, self.proj.scale, q, k, v, qi, ki, caches, want_kl
            )
            if kl is not None and aux is not None:
                aux.add("indexer_kl", kl)
            return self.proj.gated_output(gate, out)
        replay_rows = None
        if forced is not None:
            assert isinstance(routing, RoutingReplay)
            replay_rows = (
                routing.rows if routing.rows is not None else torch.ones(n, dtype=torch.bool)
            )
            forced, replay_rows = forced.to(x.device), replay_rows.to(x.device)
        outs, chosen = [], []
        for s, cache in zip(spans, caches, strict=True):
            rows = slice(s.row, s.row + s.n)
            cache.append(k[rows], v[rows], ki[rows], cfg.sparse_block)
            replay = (forced[rows], replay_rows[rows]) if forced is not None else None  # type: ignore[index]
            out, ids = self._attend(q[rows], qi[rows], s.pos, cache, aux, replay, record)
            outs.append(out)
            chosen += ids
        if record:
            assert isinstance(routing, RoutingRecorder)
            routing.add_blocks(self.kind_index, cat_blocks(chosen, dim=0))
        return self.proj.gated_output(gate, torch.cat(outs, dim=0))

    def _attend(
        self,
        q: Tensor,
        qi: Tensor,
        pos0: int,
        cache: SparseKVCache,
        aux: AuxLosses | None,
        replay: tuple[Tensor, Tensor] | None,
        record: bool,
    ) -> tuple[Tensor, list[Tensor]]:
        """Attention output of the rows, and (when `record`) their selections per chunk.
        `replay`: (recorded ids (m, Hkv, W), which rows use them (m,))."""
        cfg = self.cfg
        b, tile, step = cfg.sparse_block, cfg.sparse_query_tile, cfg.tiles_per_chunk
        n_blocks = math.ceil(cache.length / b)
        pad = n_blocks * b - cache.length
        kb = F.pad(cache.k, (0, 0, 0, 0, 0, pad)).view(n_blocks, b, *cache.k.shape[1:])
        vb = F.pad(cache.v, (0, 0, 0, 0, 0, pad)).view(n_blocks, b, *cache.v.shape[1:])
        want_kl = aux is not None and torch.is_grad_enabled()
        outs, chosen = [], []
        first_tile, last_tile = pos0 // tile, (pos0 + q.shape[0] - 1) // tile
        for ja in range(first_tile, last_tile + 1, step):
            lo = max(pos0, ja * tile)
            hi = min(pos0 + q.shape[0], (ja + step) * tile)
            rows = slice(lo - pos0, hi - pos0)
            forced = (replay[0][rows], replay[1][rows]) if replay is not None else (None, None)
            out, kl, ids = checkpointed(
                self._attend_tiles,
                q[rows],
                qi[rows],
                lo,
                ja,
                kb,
                vb,
                cache.block_keys,
                want_kl,
                *forced,
                record,
            )
            outs.append(out)
            chosen.append(ids)
            if want_kl:
                aux.add("indexer_kl", kl)
        return torch.cat(outs, dim=0), chosen if record else []

    def _attend_tiles(
        self,
        q: Tensor,
        qi: Tensor,
        lo: int,
        first_tile: int,
        kb: Tensor,
        vb: Tensor,
        block_keys: Tensor,
        want_kl: bool,
        forced: Tensor | None,
        forced_rows: Tensor | None,
        record: bool,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Queries at positions [lo, lo + m), all in tiles >= first_tile, over their unions;
        returns (output rows, indexer KL, the rows' selections (m, Hkv, W) or an empty one)."""
        cfg = self.cfg
        b, tile, hkv = cfg.sparse_block, cfg.sparse_query_tile, cfg.n_kv_groups
        g, dev = cfg.n_heads // hkv, q.device
        m, n_blocks = q.shape[0], kb.shape[0]
        positions = torch.arange(lo, lo + m, device=dev)
        scores, selected = self._select(qi, positions, block_keys, n_blocks)
        if forced is not None and forced_rows is not None:
            recorded = blocks_mask(forced, n_blocks)
            selected = torch.where(forced_rows[:, None, None], recorded, selected)
        chosen = selected_ids(selected) if record else selected.new_zeros(0, dtype=torch.int64)
        current = torch.arange(n_blocks, device=dev)[None, :] == (positions // b)[:, None]
        attends = selected | current[:, None, :]  # (m, Hkv, n_blocks)

        tile_of_row, offset = positions // tile - first_tile, positions % tile
        n_tiles = int(tile_of_row[-1]) + 1
        grid = torch.zeros(n_tiles, tile, hkv, n_blocks, dtype=torch.bool, device=dev)
        grid[tile_of_row, offset] = attends
        grid = grid.permute(0, 2, 1, 3)  # (tiles, Hkv, Tq, n_blocks)
        union = grid.any(dim=2)  # (tiles, Hkv, n_blocks)
        u = int(union.sum(-1).max())
        order = torch.where(union, torch.arange(n_blocks, device=dev), n_blocks)
        ids = order.sort(dim=-1).values[..., :u]  # ascending block ids, padding last
        valid = ids < n_blocks
        ids = ids.clamp_max(n_blocks - 1)

        group = torch.arange(hkv, device=dev)[None, :, None]
        k_items = kb.permute(2, 0, 1, 3)[group, ids].reshape(n_tiles * hkv, u, b, -1)
        v_items = vb.permute(2, 0, 1, 3)[group, ids].reshape(n_tiles * hkv, u, b, -1)
        row_attends = grid.gather(-1, ids[:, :, None, :].expand(n_tiles, hkv, tile, u))
        qpos = (first_tile + torch.arange(n_tiles, device=dev))[:, None] * tile + torch.arange(
            tile, device=dev
        )  # (tiles, Tq)
        kpos = ids[..., None] * b + torch.arange(b, device=dev)  # (tiles, Hkv, U, B)
        causal = kpos[:, :, None] <= qpos[:, None, :, None, None]  # (tiles, Hkv, Tq, U, B)
        vis = row_attends[..., None] & causal & valid[:, :, None, :, None]
        vis = vis[:, :, :, None].expand(n_tiles, hkv, tile, g, u, b)
        q_items = rows_to_items(q, tile_of_row, offset, n_tiles, tile, hkv)
        out, mass = kernels.block_attention(
            q_items, k_items, v_items, vis.reshape(n_tiles * hkv, tile * g, u, b), self.proj.scale
        )
        kl = (
            self._indexer_loss(mass, scores, selected, ids, tile_of_row, offset, n_tiles)
            if want_kl
            else torch.zeros((), device=dev)
        )
        return items_to_rows(out, tile_of_row, offset, n_tiles, tile, hkv), kl, chosen

    def _indexer_loss(
        self,
        mass: Tensor,
        scores: Tensor,
        selected: Tensor,
        ids: Tensor,
        tile_of_row: Tensor,
        offset: Tensor,
        n_tiles: int,
    ) -> Tensor:
        """KL(main attention mass on selected blocks || index softmax over them), per query."""
        cfg = self.cfg
        hkv, tile = cfg.n_kv_groups, cfg.sparse_query_tile
        g = cfg.n_heads // hkv
        u = ids.shape[-1]
        # mass (tiles*Hkv, Tq*G, U) -> per query row and group, averaged over the group's heads
        per_item = mass.detach().view(n_tiles, hkv, tile, g, u).mean(dim=3)
        target = per_item[tile_of_row, :, offset]  # (m, Hkv, U)
        row_ids = ids[tile_of_row]  # (m, Hkv, U)
        keep = selected.gather(-1, row_ids)
        logits = scores.gather(-1, row_ids).masked_fill(~keep, float("-inf"))
        target = target.masked_fill(~keep, 0.0)
        total = target.sum(-1, keepdim=True)
        usable = (keep.sum(-1) > 1) & (total.squeeze(-1) > 0)
        if not bool(usable.any()):
            return torch.zeros((), device=mass.device)
        target = target / total.clamp_min(1e-30)
        log_pred = torch.log_softmax(logits, dim=-1).masked_fill(~keep, 0.0)
        log_target = torch.log(target.clamp_min(1e-30))
        kl = (target * (log_target - log_pred)).sum(-1)
        return kl[usable].mean()

    def _select(
        self, qi: Tensor, positions: Tensor, block_keys: Tensor, n_blocks: int
    ) -> tuple[Tensor, Tensor]:
        """Index scores (m, Hkv, n_blocks) (-inf where not a past block) and the top-k mask."""
        cfg = self.cfg
        m, hkv = qi.shape[0], cfg.n_kv_groups
        scores = qi.new_full((m, hkv, n_blocks), float("-inf"))
        selected = torch.zeros(m, hkv, n_blocks, dtype=torch.bool, device=qi.device)
        n_complete = block_keys.shape[0]
        if n_complete == 0:
            return scores, selected
        raw = kernels.matmul_nt(qi.reshape(m * hkv, -1), block_keys).view(m, hkv, n_complete)
        past = (
            torch.arange(n_complete, device=qi.device)[None, :]
            < (positions // cfg.sparse_block)[:, None]
        )
        raw = raw.masked_fill(~past[:, None, :], float("-inf"))
        top_val, top_idx = raw.topk(min(cfg.sparse_selected_blocks, n_complete), dim=-1)
        selected[..., :n_complete] = torch.zeros_like(raw, dtype=torch.bool).scatter(
            -1, top_idx, torch.isfinite(top_val)
        )
        scores = torch.cat([raw, scores[..., n_complete:]], dim=-1)
        return scores, selected


def selected_ids(selected: Tensor) -> Tensor:
    """Selection mask (m, Hkv, n_blocks) -> ascending block ids (m, Hkv, W), -1 padded, W the
    largest count of any row (a row before the (k/B + 1)-th block selects all it can see)."""
    n_blocks = selected.shape[-1]
    width = int(selected.sum(-1).max()) if selected.numel() else 0
    order = torch.where(selected, torch.arange(n_blocks, device=selected.device), n_blocks)
    ids = order.sort(dim=-1).values[..., :width]
    return torch.where(ids < n_blocks, ids, -1)


def blocks_mask(ids: Tensor, n_blocks: int) -> Tensor:
    """Inverse of `selected_ids`: ids (m, Hkv, W) (-1 padded) -> mask (m, Hkv, n_blocks)."""
    slot = torch.where(ids >= 0, ids, n_blocks).clamp_max(n_blocks)
    mask = torch.zeros(*ids.shape[:-1], n_blocks + 1, dtype=torch.bool, device=ids.device)
    return mask.scatter(-1, slot, True)[..., :n_blocks]
