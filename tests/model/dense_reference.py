"""Straightforward dense implementations, written independently of rlsys.model/kernels.

Per-query loops and plain `@` / `softmax`: slow, obviously correct, used only by tests.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def rope(x: Tensor, theta: float) -> Tensor:
    """x (L, H, D) rotated by positions 0..L-1 (rotate-half convention)."""
    length, _, d = x.shape
    half = d // 2
    freq = 1.0 / theta ** (torch.arange(half, dtype=torch.float64) * 2 / d)
    ang = torch.arange(length, dtype=torch.float64)[:, None] * freq[None, :]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x[..., :half].double(), x[..., half:].double()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def projections(layer, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:  # type: ignore[no-untyped-def]
    cfg, p = layer.cfg, layer.proj
    length = x.shape[0]
    q = (x @ p.wq.float().T).view(length, cfg.n_heads, cfg.head_dim)
    k = (x @ p.wk.float().T).view(length, cfg.n_kv_groups, cfg.head_dim)
    v = (x @ p.wv.float().T).view(length, cfg.n_kv_groups, cfg.head_dim)
    return rope(q, cfg.rope_theta), rope(k, cfg.rope_theta), v


def attend(q: Tensor, k: Tensor, v: Tensor, allowed: list[int]) -> Tensor:
    """One query head over the allowed key positions: softmax(q.k / sqrt(D)) @ v."""
    idx = torch.tensor(sorted(allowed))
    w = torch.softmax((k[idx] @ q) / math.sqrt(q.shape[-1]), dim=0)
    return w @ v[idx]


def finish(layer, x: Tensor, attn: Tensor) -> Tensor:  # type: ignore[no-untyped-def]
    p = layer.proj
    gate = torch.sigmoid(x @ p.wgate.float().T)
    return (attn * gate[..., None]).reshape(x.shape[0], -1) @ p.wo.float().T


def layer_output(layer, x: Tensor, allowed_fn) -> Tensor:  # type: ignore[no-untyped-def]
    """Gated GQA layer output where `allowed_fn(t, g)` lists the key positions query t sees."""
    cfg = layer.cfg
    q, k, v = projections(layer, x)
    g_size = cfg.n_heads // cfg.n_kv_groups
    out = torch.zeros(x.shape[0], cfg.n_heads, cfg.head_dim)
    for t in range(x.shape[0]):
        for h in range(cfg.n_heads):
            g = h // g_size
            out[t, h] = attend(q[t, h], k[:, g], v[:, g], allowed_fn(t, g))
    return finish(layer, x, out)


def causal(t: int, g: int) -> list[int]:
    return list(range(t + 1))


def sliding(window: int):  # type: ignore[no-untyped-def]
    return lambda t, g: list(range(max(0, t - window + 1), t + 1))


def block_topk_selection(layer, x: Tensor) -> dict[tuple[int, int], list[int]]:  # type: ignore[no-untyped-def]
    """Sparse GQA selection: (t, g) -> selected past block ids, from mean-merged index keys."""
    cfg = layer.cfg
    b, n_sel = cfg.sparse_block, cfg.sparse_topk // cfg.sparse_block
    qi = (x @ layer.w_index_q.float().T).view(x.shape[0], cfg.n_kv_groups, cfg.index_dim)
    qi = rope(qi, cfg.rope_theta)
    ki = rope((x @ layer.w_index_k.float().T)[:, None, :], cfg.rope_theta)[:, 0]
    n_full = x.shape[0] // b
    block_keys = ki[: n_full * b].view(n_full, b, -1).mean(dim=1)
    chosen = {}
    for t in range(x.shape[0]):
        past = t // b
        for g in range(cfg.n_kv_groups):
            if past == 0:
                chosen[t, g] = []
                continue
            scores = block_keys[:past] @ qi[t, g]
            chosen[t, g] = scores.topk(min(n_sel, past)).indices.tolist()
    return chosen


def sparse_allowed(layer, x: Tensor):  # type: ignore[no-untyped-def]
    """allowed_fn for Sparse GQA: selected blocks' positions + the current block up to t."""
    b = layer.cfg.sparse_block
    chosen = block_topk_selection(layer, x)

    def allowed(t: int, g: int) -> list[int]:
        picked = [blk * b + s for blk in chosen[t, g] for s in range(b)]
        return picked + list(range((t // b) * b, t + 1))

    return allowed


def token_topk_allowed(layer, x: Tensor):  # type: ignore[no-untyped-def]
    """allowed_fn for token-level top-k (DSA-like): top-k past tokens by index score + t."""
    cfg = layer.cfg
    qi = (x @ layer.w_index_q.float().T).view(x.shape[0], cfg.n_kv_groups, cfg.index_dim)
    qi = rope(qi, cfg.rope_theta)
    ki = rope((x @ layer.w_index_k.float().T)[:, None, :], cfg.rope_theta)[:, 0]

    def allowed(t: int, g: int) -> list[int]:
        if t == 0:
            return [0]
        scores = ki[:t] @ qi[t, g]
        return scores.topk(min(cfg.sparse_topk, t)).indices.tolist() + [t]

    return allowed
