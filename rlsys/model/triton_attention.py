"""The model's attention on the Triton path (CUDA; the CPU under the interpreter in tests).

Imported only when a forward takes the Triton path, so the CPU reference path never
imports triton. Both attention kinds read keys through the forward's `TritonKV`
(`rlsys.model.kv_layout`): the trainer's packed K/V, or the engine's page pool, which the
new tokens' K/V (and index keys) are written into in place first. Both run the same
kernels with the same geometry, so a token's output is the same in a decode step, a
chunked prefill and the trainer's packed forward.
Tensor legend: N rows, H heads, Hkv KV groups, D head dim, IDX index dim, NB blocks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from rlsys import kernels
from rlsys.config.model import ModelConfig
from rlsys.kernels.triton_ops.attention import (
    AttentionShape,
    packed_attention,
    paged_attention,
    selected_block_mass,
)
from rlsys.kernels.triton_ops.common import dot_precision
from rlsys.kernels.triton_ops.indexer import union_steps
from rlsys.kernels.triton_ops.qkv_post import IndexOut
from rlsys.kernels.triton_ops.selection import select_top_blocks
from rlsys.model.attention import AttentionProjections
from rlsys.model.indexer_kl import indexer_kl
from rlsys.model.kv_layout import PackedLayout, PagedLayout, TritonKV
from rlsys.model.rope import inv_freq

# ---- the two attention kinds ----------------------------------------------------------------


def swa_attention(
    cfg: ModelConfig, layer: int, scale: float, q: Tensor, k: Tensor, v: Tensor, kv: TritonKV
) -> Tensor:
    """Gated SWA's attention (before the output gate): (N, H, D)."""
    shape = AttentionShape(scale, kv.geo.swa_step, window=cfg.swa_window)
    if kv.packed is not None:
        return packed_attention(q, k, v, kv.tiles, kv.packed.kv, kv.packed.seq_lens, shape)[0]
    paged = kv.paged
    assert paged is not None
    k_pool, v_pool = paged.pool.swa_k[layer], paged.pool.swa_v[layer]
    k_pool.index_copy_(0, paged.swa_rows, k)
    v_pool.index_copy_(0, paged.swa_rows, v)
    return paged_attention(q, k_pool, v_pool, kv.tiles, paged.swa_kv, shape)


def swa_attention_fused(
    cfg: ModelConfig, layer: int, proj: AttentionProjections, x: Tensor, positions: Tensor,
    kv: TritonKV,
) -> Tensor:  # fmt: skip
    """Inference over the page pool, fused: the projection product and its epilogue (k/v
    written to the pool), then attention with the output gate in its epilogue; returns the
    gated heads (N, H, D), bitwise the unfused path's."""
    paged = kv.paged
    assert paged is not None
    k_pool, v_pool = paged.pool.swa_k[layer], paged.pool.swa_v[layer]
    q, gate = proj.project_into_pools(x, positions, k_pool, v_pool, paged.swa_rows)
    shape = AttentionShape(proj.scale, kv.geo.swa_step, window=cfg.swa_window)
    return paged_attention(q, k_pool, v_pool, kv.tiles, paged.swa_kv, shape, gate=gate)


def sparse_attention_fused(
    cfg: ModelConfig, layer: int, proj: AttentionProjections, yi: Any, index_cols: list[int],
    x: Tensor, positions: Tensor, kv: TritonKV,
) -> Tensor:  # fmt: skip
    """`swa_attention_fused` for Sparse GQA: `yi` are the rows of the index product (its
    index-query and index-key columns at `index_cols`); the epilogue also writes index
    keys (and, in a decode step, the keys of the blocks its tokens complete)."""
    paged = kv.paged
    assert paged is not None
    pool, b = paged.pool, cfg.sparse_block
    k_pool, v_pool = pool.sparse_k[layer], pool.sparse_v[layer]
    bk_pool = pool.block_keys[layer]
    qi = torch.empty(x.shape[0], cfg.n_kv_groups, cfg.index_dim, device=x.device)
    by_row = paged.blocks_by_row
    index = IndexOut(
        yi,
        index_cols,
        qi,
        pool.index_keys[layer],
        inv_freq(cfg.index_dim, cfg.rope_theta, x.device),
        bk_pool if by_row else None,
        paged.block_token_rows if by_row else None,
        paged.block_rows if by_row else None,
    )
    q, gate = proj.project_into_pools(x, positions, k_pool, v_pool, paged.sparse_rows, index, b)
    if not by_row:
        _merge_block_keys(pool.index_keys[layer], bk_pool, paged, b)
    sel = select_top_blocks(
        qi, bk_pool, kv.tiles, paged.bk, topk_blocks=cfg.sparse_selected_blocks, block=b,
        precision=dot_precision(q.dtype), ids=False,  # the attention reads only the bitmap
    )  # fmt: skip
    step_off, step_ids = union_steps(sel, kv.tiles, block=b, step=kv.geo.sparse_step)
    shape = AttentionShape(
        proj.scale, kv.geo.sparse_step, sparse=(step_off, step_ids, sel.bits), block=b
    )
    return paged_attention(q, k_pool, v_pool, kv.tiles, paged.sparse_kv, shape, gate=gate)


def _merge_block_keys(index_keys: Tensor, bk_pool: Tensor, paged: PagedLayout, b: int) -> None:
    """Block keys of the blocks this call completed: the in-order mean of their B keys."""
    if paged.block_rows.numel():
        tok = index_keys[paged.block_token_rows]  # (n_done, B, IDX)
        bk_pool.index_copy_(0, paged.block_rows, kernels.sequential_sum(tok, dim=1) / b)


def sparse_attention(
    cfg: ModelConfig,
    layer: int,
    scale: float,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    qi: Tensor,
    ki: Tensor,
    kv: TritonKV,
    want_kl: bool,
) -> tuple[Tensor, Tensor | None]:
    """Sparse GQA's attention (N, H, D), and the indexer KL when `want_kl` (training)."""
    b, ksel = cfg.sparse_block, cfg.sparse_selected_blocks
    if kv.packed is not None:
        bk = _packed_block_keys(ki, kv.packed, b)
        k_pool, v_pool, bk_pool = k, v, bk
        table, bk_table = kv.packed.kv, kv.packed.bk
    else:
        paged = kv.paged
        assert paged is not None
        pool = paged.pool
        k_pool, v_pool = pool.sparse_k[layer], pool.sparse_v[layer]
        k_pool.index_copy_(0, paged.sparse_rows, k)
        v_pool.index_copy_(0, paged.sparse_rows, v)
        pool.index_keys[layer].index_copy_(0, paged.sparse_rows, ki)
        bk_pool = pool.block_keys[layer]
        _merge_block_keys(pool.index_keys[layer], bk_pool, paged, b)
        table, bk_table = paged.sparse_kv, paged.bk
    sel = select_top_blocks(
        qi.detach(),
        bk_pool.detach(),
        kv.tiles,
        bk_table,
        topk_blocks=ksel,
        block=b,
        precision=dot_precision(q.dtype),  # tf32 index scores for bf16 models, both sides
        ids=want_kl and kv.packed is not None,  # only the indexer KL reads the ids
    )
    step_off, step_ids = union_steps(sel, kv.tiles, block=b, step=kv.geo.sparse_step)
    shape = AttentionShape(
        scale, kv.geo.sparse_step, sparse=(step_off, step_ids, sel.bits), block=b
    )
    if kv.packed is None:
        return paged_attention(q, k_pool, v_pool, kv.tiles, table, shape), None
    out, lse = packed_attention(q, k, v, kv.tiles, table, kv.packed.seq_lens, shape)
    if not want_kl:
        return out, None
    mass = selected_block_mass(q.detach(), k.detach(), lse, kv.tiles, table, shape, ksel)
    return out, indexer_kl(qi, bk_pool, sel, mass, kv.packed, block=b, dtype=q.dtype)


def _packed_block_keys(ki: Tensor, layout: PackedLayout, b: int) -> Tensor:
    """Merged index keys of every complete block, sequence after sequence (with autograd)."""
    parts = []
    for (row, _), count in zip(layout.rows, layout.block_counts, strict=True):
        full = ki[row : row + count * b].view(count, b, -1)
        parts.append(
            kernels.sequential_sum(full, dim=1) / b if count else ki.new_zeros(1, ki.shape[-1])
        )
    return torch.cat(parts)
