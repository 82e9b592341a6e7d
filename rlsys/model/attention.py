"""Shared parts of the two attention kinds: projections, rotary, the sigmoid output gate.

Tensor legend: N packed token rows, H query heads, G = H / n_kv_groups heads per KV group,
Hkv KV groups, D head dim. Invariant: every projection is `kernels.linear` (row-invariant),
so a token's q/k/v/gate do not depend on the other rows in the packed batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from rlsys import kernels
from rlsys.config.model import ModelConfig
from rlsys.kernels.tp import RowParallel
from rlsys.model.rope import apply_rope


@dataclass(frozen=True)
class SeqSpan:
    """One sequence's rows in a packed batch: rows [row, row + n) hold positions [pos, pos+n)."""

    row: int
    n: int
    pos: int


def init_weight(shape: tuple[int, ...], std: float, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.randn(shape, dtype=torch.float32).mul_(std).to(dtype))


class AttentionProjections(nn.Module):
    """q/k/v/gate/output weights of one attention layer (gated GQA)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        d, h, hkv, hd = cfg.d_model, cfg.n_heads, cfg.n_kv_groups, cfg.head_dim
        std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.n_layers)
        self.wq = init_weight((h * hd, d), std, dtype)
        self.wk = init_weight((hkv * hd, d), std, dtype)
        self.wv = init_weight((hkv * hd, d), std, dtype)
        self.wgate = init_weight((h, d), std, dtype)
        self.wo = init_weight((d, h * hd), out_std, dtype)
        self.scale = 1.0 / math.sqrt(hd)
        # Tensor parallelism (rlsys.engine.tp_shard): this rank's share of the output
        # projection, and which columns of its heads' output feed it (None: all).
        self.row_parallel = RowParallel()
        self.out_cols: tuple[int, int] | None = None

    def qkv(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Rotated q (N, H, D), k (N, Hkv, D) and v (N, Hkv, D)."""
        cfg = self.cfg
        n = x.shape[0]
        q = kernels.linear(x, self.wq).view(n, cfg.n_heads, cfg.head_dim)
        k = kernels.linear(x, self.wk).view(n, cfg.n_kv_groups, cfg.head_dim)
        v = kernels.linear(x, self.wv).view(n, cfg.n_kv_groups, cfg.head_dim)
        return apply_rope(q, positions, cfg.rope_theta), apply_rope(k, positions, cfg.rope_theta), v

    def gated_output(self, x: Tensor, attn: Tensor) -> Tensor:
        """Scale each head by sigmoid(x . w_gate_h), then project: (N, H, D) -> (N, d) fp32.

        The projection reduces over heads x head_dim, which TP splits: it always runs as the
        fixed 8-chunk tree (`kernels.tp`), at TP=1 too, so every degree gets the same bits.
        """
        gate = kernels.sigmoid(kernels.linear(x, self.wgate)).to(attn.dtype)
        mixed = (attn * gate.unsqueeze(-1)).reshape(attn.shape[0], -1)
        if self.out_cols is not None:
            mixed = mixed[:, self.out_cols[0] : self.out_cols[1]]
        return self.row_parallel.linear(mixed, self.wo)


def rows_to_items(
    q: Tensor, tile_of_row: Tensor, offset_in_tile: Tensor, n_tiles: int, tile: int, n_kv: int
) -> Tensor:
    """Scatter queries (n, H, D) into items (n_tiles * Hkv, tile * G, D); absent rows are 0.

    Row layout inside an item: (position within tile, head within group), so a query sits
    at the same row whether it arrives alone (decode) or with its whole tile (prefill).
    """
    n, h, d = q.shape
    g = h // n_kv
    items = q.new_zeros(n_tiles, tile, n_kv, g, d)
    items[tile_of_row, offset_in_tile] = q.view(n, n_kv, g, d)
    return items.permute(0, 2, 1, 3, 4).reshape(n_tiles * n_kv, tile * g, d)


def items_to_rows(
    out: Tensor, tile_of_row: Tensor, offset_in_tile: Tensor, n_tiles: int, tile: int, n_kv: int
) -> Tensor:
    """Inverse of `rows_to_items`: items (n_tiles * Hkv, tile * G, D) -> (n, H, D)."""
    d = out.shape[-1]
    g = out.shape[1] // tile
    grid = out.view(n_tiles, n_kv, tile, g, d).permute(0, 2, 1, 3, 4)
    return grid[tile_of_row, offset_in_tile].reshape(tile_of_row.shape[0], n_kv * g, d)


def checkpointed(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)`; under autograd, recomputed in the backward instead of stored.

    Why: a chunk of attention tiles holds O(chunk * keys) intermediates; storing them for
    every chunk of a 16K-token sequence would cost O(L * k * tile) memory.
    """
    if torch.is_grad_enabled() and any(isinstance(a, Tensor) and a.requires_grad for a in args):
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)
