"""Row-parallel products with one fixed reduction tree for every tensor-parallel degree.

A row-parallel projection (attention output, FFN/expert down projection) reduces over an
input dimension K that tensor parallelism splits across ranks. Summing rank partials in
whatever order a collective picks would make the result depend on the TP degree. Here the
K reduction is ALWAYS computed as `SPLITS` = 8 fixed chunks p0..p7 (each a fixed-tile
`bmm`, like `reference.linear`) summed in fp32 as the balanced tree
((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7)):
- TP=1 (the trainer) computes the whole tree;
- TP=t, rank r owns chunks [8r/t, 8(r+1)/t), a complete subtree, and sums it;
- the t rank subtotals are all-gathered and every rank sums them in rank order with the
  same balanced tree (never relying on an all-reduce's order).
Since every subtree of a balanced tree is contiguous, all degrees (1, 2, 4, 8) compute
bitwise the same value. Column-parallel products need no tree: a column of a fixed-tile
product does not depend on the other columns (checked in tests/kernels).
On CUDA the chunk products and the tree run in one Triton kernel (`triton_ops.linear`)
with the same structure. Invariant: imports torch only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from rlsys.kernels.dispatch import use_triton
from rlsys.kernels.reference import ROW_TILE

SPLITS = 8
TP_DEGREES = (1, 2, 4, 8)

Gather = Callable[[Tensor], list[Tensor]]


def tree_sum(parts: Tensor) -> Tensor:
    """Balanced pairwise sum over dim 0 of 2^j parts: ((p0 + p1) + (p2 + p3)) + ..."""
    assert parts.shape[0] & (parts.shape[0] - 1) == 0, "a power-of-two number of parts"
    while parts.shape[0] > 1:
        parts = parts[0::2] + parts[1::2]
    return parts[0]


def row_partial(x: Tensor, w: Tensor, n_chunks: int) -> Tensor:
    """fp32 tree sum of the chunk products `x[:, c] @ w[:, c].T` over `n_chunks` chunks.

    x (..., K), w (N, K), K = n_chunks * chunk. Each chunk product is a fixed-shape
    (ROW_TILE, chunk) x (chunk, N) `bmm` item, so its value does not depend on the number
    of rows, on the rank that computes it or on the other chunks. One `bmm` call holds all
    (chunk, row tile) items, chunk-major.
    """
    lead, k = x.shape[:-1], x.shape[-1]
    assert k % n_chunks == 0, (k, n_chunks)
    size, n = k // n_chunks, w.shape[0]
    rows = x.reshape(-1, k).to(w.dtype)
    m = rows.shape[0]
    items = F.pad(rows, (0, 0, 0, (-m) % ROW_TILE)).view(-1, ROW_TILE, n_chunks, size)
    mt = items.shape[0]
    lhs = items.permute(2, 0, 1, 3).reshape(n_chunks * mt, ROW_TILE, size)
    w_chunks = w.view(n, n_chunks, size).permute(1, 2, 0).unsqueeze(1)  # (c, 1, size, N)
    rhs = w_chunks.expand(n_chunks, mt, size, n).reshape(n_chunks * mt, size, n)
    prod = torch.bmm(lhs, rhs).float().view(n_chunks, mt * ROW_TILE, n)
    return tree_sum(prod)[:m].reshape(*lead, n)


@dataclass(frozen=True)
class RowParallel:
    """One rank's share of every row-parallel reduction of a model (see module doc).

    `gather(t)` returns every rank's `t` in rank order (torch.distributed all_gather, or an
    in-process exchange between shard threads); None at degree 1.
    """

    degree: int = 1
    rank: int = 0
    gather: Gather | None = None

    def __post_init__(self) -> None:
        assert self.degree in TP_DEGREES and 0 <= self.rank < self.degree
        assert self.degree == 1 or self.gather is not None

    @property
    def chunks(self) -> int:
        """Chunks of the fixed 8-way split this rank owns."""
        return SPLITS // self.degree

    def partial(self, x: Tensor, w_shard: Tensor) -> Tensor:
        """This rank's subtotal; `w_shard` holds the K columns of this rank's chunks."""
        if use_triton(x):
            from rlsys.kernels.triton_ops.autograd import LinearTree

            lead, k = x.shape[:-1], x.shape[-1]
            out = LinearTree.apply(x.reshape(-1, k), w_shard, self.chunks)
            return out.reshape(*lead, w_shard.shape[0])
        return row_partial(x, w_shard, self.chunks)

    def reduce(self, subtotal: Tensor) -> Tensor:
        """Combine the ranks' subtotals with the fixed tree (identity at degree 1)."""
        if self.degree == 1:
            return subtotal
        assert self.gather is not None
        return tree_sum(torch.stack(self.gather(subtotal.contiguous())))

    def linear(self, x: Tensor, w_shard: Tensor) -> Tensor:
        """Row-parallel `x @ w.T` in fp32, bitwise the same for every degree."""
        return self.reduce(self.partial(x, w_shard))
