"""Shared parts of the two attention kinds: projections, rotary, the sigmoid output gate.

Tensor legend: N packed token rows, H query heads, G = H / n_kv_groups heads per KV group,
Hkv KV groups, D head dim. Invariant: every projection is `kernels.linear` (row-invariant),
so a token's q/k/v/gate do not depend on the other rows in the packed batch.
q, k, v and the gate come from ONE product over the concatenated weights in every path
(`fused_product`: the same shape in training and inference, so a column is the same
whichever implementation the linear picks for that shape); at inference on the engine's
page pool its epilogue is one kernel (`project_into_pools`, `triton_ops.qkv_post`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from rlsys.config.model import ModelConfig
from rlsys.kernels import fused
from rlsys.kernels.tp import RowParallel
from rlsys.model.fused_weights import FusedWeight, fused_partials, fused_product
from rlsys.model.rope import apply_rope, inv_freq

FUSED_ALIGN = 64  # fused parts start on a multiple of the linear's column tile


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
        self._fused = FusedWeight(FUSED_ALIGN)

    def product(self, x: Tensor) -> tuple[Tensor, list[int]]:
        """`x @ [wq; wk; wv; wgate].T` in one product (N, Ntot), and each part's first
        column (`fused_product`)."""
        return fused_product(x, [self.wq, self.wk, self.wv, self.wgate], self._fused)

    def refresh_fused(self) -> None:
        """Bring the cached inference weight up to date (before a CUDA-graph replay)."""
        self._fused.refresh([self.wq, self.wk, self.wv, self.wgate])

    def qkv(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Rotated q (N, H, D), k (N, Hkv, D), v (N, Hkv, D) and the output gate (N, H) in
        the compute dtype."""
        cfg = self.cfg
        n, hd = x.shape[0], cfg.head_dim
        y, (oq, ok, ov, og) = self.product(x)
        widths = (cfg.n_heads * hd, cfg.n_kv_groups * hd, cfg.n_kv_groups * hd, cfg.n_heads)
        yq, yk, yv, yg = column_parts(y, tuple(zip((oq, ok, ov, og), widths, strict=True)))
        q = yq.reshape(n, cfg.n_heads, hd)
        k = yk.reshape(n, cfg.n_kv_groups, hd)
        # contiguous: the attention kernels read v with k's strides
        v = yv.reshape(n, cfg.n_kv_groups, hd).contiguous()
        gate = fused.sigmoid(yg, y.dtype)
        rot_q, rot_k = (
            apply_rope(q, positions, cfg.rope_theta),
            apply_rope(k, positions, cfg.rope_theta),
        )
        return rot_q, rot_k, v, gate

    def project_into_pools(
        self,
        x: Tensor,
        positions: Tensor,
        k_pool: Tensor,
        v_pool: Tensor,
        kv_rows: Tensor,
        index: Any = None,
        block: int = 1,
    ) -> tuple[Tensor, Tensor]:
        """Inference: `qkv`'s values in two launches, the product and its epilogue
        (`triton_ops.qkv_post`), which writes k/v (and `index`'s keys) into pool rows
        `kv_rows`; returns (rotated q (N, H, D), gate (N, H)), bitwise `qkv`'s."""
        from rlsys.kernels.triton_ops.qkv_post import qkv_post

        y, offsets = fused_partials(x, [self.wq, self.wk, self.wv, self.wgate], self._fused)
        freqs = inv_freq(self.cfg.head_dim, self.cfg.rope_theta, x.device)
        return qkv_post(
            y, offsets, positions, kv_rows, freqs, k_pool, v_pool, self.cfg.n_heads, block, index
        )

    def gated_output(self, gate: Tensor, attn: Tensor) -> Tensor:
        """Scale each head by its gate (sigmoid(x . w_gate_h), from `qkv`), then project:
        (N, H, D) -> (N, d) fp32.

        The projection reduces over heads x head_dim, which TP splits: it always runs as the
        fixed 8-chunk tree (`kernels.tp`), at TP=1 too, so every degree gets the same bits.
        """
        return self.output(attn * gate.unsqueeze(-1))

    def output(self, gated: Tensor) -> Tensor | Any:
        """The output projection of gated heads (N, H, D) -> (N, d) fp32. At inference on
        one rank: its unreduced chunk products (`triton_ops.partials`), which the block's
        residual add and norm sum (one launch fewer, the same value)."""
        mixed = gated.reshape(gated.shape[0], -1)
        if self.out_cols is not None:
            mixed = mixed[:, self.out_cols[0] : self.out_cols[1]]
        if self.row_parallel.degree == 1 and fused.partials_ok(mixed):
            from rlsys.kernels.triton_ops.partials import partial_products, triton_computes

            if triton_computes("row_tree", self.wo):
                return partial_products(mixed, self.wo, self.row_parallel.chunks)
        return self.row_parallel.linear(mixed, self.wo)


class _ColumnParts(torch.autograd.Function):
    """Column slices of one product as one autograd node. Its backward concatenates the
    parts' gradients with zero blocks for the padding (one launch and a fill per gap) when
    every part has one, else writes them into one zero-filled tensor of its shape (one fill
    and a copy per part), where a slice per part would fill a full-size tensor each and add
    them up."""

    @staticmethod
    def forward(ctx: Any, y: Tensor, parts: tuple[tuple[int, int], ...]) -> tuple[Tensor, ...]:
        ctx.shape, ctx.parts = y.shape, parts
        ctx.set_materialize_grads(False)
        return tuple(y[:, start : start + width] for start, width in parts)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, None]:
        given = [g for g in grads if g is not None]
        if not given:
            return None, None
        if len(given) == len(grads) and _ascending(ctx.parts):
            # one concatenation, zeros only for the padding between and after the parts
            return torch.cat(_with_padding(given, ctx.parts, ctx.shape[1]), dim=1), None
        full = given[0].new_zeros(ctx.shape)
        for (start, width), g in zip(ctx.parts, grads, strict=True):
            if g is not None:
                full[:, start : start + width] = g
        return full, None


def _ascending(parts: tuple[tuple[int, int], ...]) -> bool:
    """Whether the parts follow each other left to right without overlapping."""
    ends = [start + width for start, width in parts]
    return all(parts[i + 1][0] >= ends[i] for i in range(len(parts) - 1))


def _with_padding(
    grads: list[Tensor], parts: tuple[tuple[int, int], ...], width: int
) -> list[Tensor]:
    """The parts' gradients in column order, with zero blocks for the columns no part has."""
    pieces, end = [], 0
    for (start, w), g in zip(parts, grads, strict=True):
        if start > end:
            pieces.append(g.new_zeros(g.shape[0], start - end))
        pieces.append(g)
        end = start + w
    if width > end:
        pieces.append(grads[0].new_zeros(grads[0].shape[0], width - end))
    return pieces


def column_parts(y: Tensor, parts: tuple[tuple[int, int], ...]) -> tuple[Tensor, ...]:
    """Views `y[:, start : start + width]` of each (start, width) part; under autograd one
    node for them all (`_ColumnParts`)."""
    if torch.is_grad_enabled() and y.requires_grad:
        return _ColumnParts.apply(y, parts)
    return tuple(y[:, start : start + width] for start, width in parts)


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
