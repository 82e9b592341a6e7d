"""The reference products of the routed experts, every expert in one `bmm` (CPU path).

`reference.linear` and `tp.row_partial` make each product a batch of fixed-shape `bmm`
items ((ROW_TILE, K) x (K, COL_TILE), and (ROW_TILE, chunk) x (chunk, N) per K chunk), so
a row's value depends on its own row only. The routed experts' products here are the same
items: each expert's rows are padded to whole ROW_TILE tiles (`ExpertTiles`) and every tile
is multiplied by its expert's weight, all tiles in one call. So a row's value is bitwise
what a per-expert call of `reference.linear` / `tp.row_partial` on that expert's rows gives
(the per-expert Python loop this replaces: one call per expert, per projection, per block
and step, which made the MoE a fifth of the CPU engine's step).

Invariants: operands are laid out contiguous, item-major, as the per-expert calls lay them
out (a `bmm` item's bits may depend on its operands' strides); padded rows are zeros and
are dropped; gradients flow through the layout (index copy / select) to rows and weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from rlsys.kernels.reference import COL_TILE, ROW_TILE
from rlsys.kernels.tp import tree_sum


@dataclass(frozen=True)
class ExpertTiles:
    """Rows sorted by expert, padded to ROW_TILE tiles: `rows` (R,) is each sorted row's
    padded position, `expert` (T,) each tile's expert."""

    rows: Tensor
    expert: Tensor

    @classmethod
    def of(cls, counts: list[int], device: torch.device) -> ExpertTiles:
        rows, expert, tile = [], [], 0
        for e, count in enumerate(counts):
            n_tiles = -(-count // ROW_TILE)
            rows.append(torch.arange(count) + tile * ROW_TILE)
            expert += [e] * n_tiles
            tile += n_tiles
        return cls(
            torch.cat(rows).to(device), torch.tensor(expert, dtype=torch.long, device=device)
        )

    @property
    def n_tiles(self) -> int:
        return self.expert.shape[0]

    def pad(self, x_sorted: Tensor) -> Tensor:
        """(R, K) sorted rows -> (T, ROW_TILE, K), zeros between the experts' rows."""
        out = x_sorted.new_zeros(self.n_tiles * ROW_TILE, x_sorted.shape[1])
        return out.index_copy(0, self.rows, x_sorted).view(self.n_tiles, ROW_TILE, -1)

    def unpad(self, y: Tensor) -> Tensor:
        """(T, ROW_TILE, N) -> (R, N): the sorted rows' values."""
        return y.reshape(-1, y.shape[-1]).index_select(0, self.rows)


def grouped_linear(x: Tensor, w: Tensor, tiles: ExpertTiles) -> Tensor:
    """Tile t of x (T, ROW_TILE, K) times w[expert[t]].T, w (E, N, K) -> (T, ROW_TILE, N),
    in w's dtype: per tile and column tile the `matmul_nt` item."""
    t, _, k = x.shape
    n = w.shape[1]
    a = x.to(w.dtype)
    b = F.pad(w, (0, 0, 0, (-n) % COL_TILE))  # (E, Np, K)
    nt = b.shape[1] // COL_TILE
    lhs = a.unsqueeze(1).expand(t, nt, ROW_TILE, k).reshape(t * nt, ROW_TILE, k)
    b_items = b.view(b.shape[0], nt, COL_TILE, k).transpose(2, 3)  # (E, nt, K, COL_TILE)
    rhs = b_items.index_select(0, tiles.expert).contiguous().view(t * nt, k, COL_TILE)
    out = torch.bmm(lhs, rhs).view(t, nt, ROW_TILE, COL_TILE).permute(0, 2, 1, 3)
    return out.reshape(t, ROW_TILE, nt * COL_TILE)[..., :n]


def grouped_row_partial(x: Tensor, w: Tensor, tiles: ExpertTiles, n_chunks: int) -> Tensor:
    """`tp.row_partial` per tile with its expert's w (E, N, K): the fp32 tree over
    `n_chunks` K chunks of the chunk products -> (T, ROW_TILE, N)."""
    t, _, k = x.shape
    e, n = w.shape[0], w.shape[1]
    size = k // n_chunks
    items = x.to(w.dtype).view(t, ROW_TILE, n_chunks, size)
    lhs = items.permute(2, 0, 1, 3).reshape(n_chunks * t, ROW_TILE, size)
    w_chunks = w.view(e, n, n_chunks, size).permute(0, 2, 3, 1)  # (E, c, size, N)
    rhs = w_chunks.index_select(0, tiles.expert).permute(1, 0, 2, 3)  # (c, T, size, N)
    rhs = rhs.contiguous().view(n_chunks * t, size, n)
    prod = torch.bmm(lhs, rhs).float().view(n_chunks, t * ROW_TILE, n)
    return tree_sum(prod).view(t, ROW_TILE, n)
