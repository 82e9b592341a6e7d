"""A batch-invariant product whose last step, the sum of its K-chunk products, is left to
the kernel that consumes it (an epilogue), one launch fewer than `triton_ops.linear`'s.

`linear`'s split schedule computes the K-chunk products of a product in one launch and
adds them in a fixed balanced tree in a second (`_tree_reduce`); its serial schedule does
both in one program. `partial_products` launches the same first kernel and returns the
chunk products (`Partials`): the consumer adds them with the same `_tree_of`, so it sees
bitwise the value `linear_fwd` / `linear_tree_fwd` / `grouped_tree_fwd` would have stored
(in fp32; adds only, no FMA to contract). Where `linear` would run serially (enough output
tiles to fill the GPU), the serial kernel stores the reduced fp32 result and `nch` is 1.
Invariant: the same schedule choice and launch configuration as `linear._launch`, so split
or serial is the speed choice it is there, never a numerical one. Callers take partials only
where the linear dispatcher would run that product on these kernels (`triton_computes`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
from torch import Tensor

from rlsys.kernels.triton_ops import linear as lin
from rlsys.kernels.triton_ops import pdl
from rlsys.kernels.triton_ops.common import check_device, dot_precision, interpreting


@dataclass(frozen=True)
class Partials:
    """Chunk products (nch, M, N) fp32, contiguous: element (r, c) of chunk j at
    j * M * N + r * N + c. The product is their balanced tree (`linear._tree_of`)."""

    p: Tensor
    nch: int

    @property
    def rows(self) -> int:
        return int(self.p.shape[1])

    @property
    def cols(self) -> int:
        return int(self.p.shape[2])

    def reduced(self) -> Tensor:
        """The product itself (M, N) fp32 (one reduction launch; tests and fallbacks)."""
        if self.nch == 1:
            return self.p[0]
        out = torch.empty(self.rows, self.cols, dtype=torch.float32, device=self.p.device)
        mn = self.rows * self.cols
        lin._tree_reduce[(triton.cdiv(mn, lin.REDUCE_BLOCK),)](
            self.p, out, mn, self.cols, out.stride(0), out.stride(1),
            NCH=self.nch, SWIGLU=False, BLOCK=lin.REDUCE_BLOCK,
        )  # fmt: skip
        return out


def triton_computes(kind: str, w: Tensor) -> bool:
    """Whether the linear dispatcher (`triton_ops.products`) computes a product of `kind`
    ("column", "row_tree", "grouped_tree") with weight `w` on the Triton kernels: only then
    may a consumer take its partial products and still see the dispatcher's bits."""
    from rlsys.kernels.triton_ops import products as pr

    impl = pr.products()
    if isinstance(impl, pr.PlainProducts):
        return False
    if isinstance(impl, pr.InvariantProducts) and kind == "column":
        return not pr._holds("column", tuple(w.shape), w.dtype, w.device)
    return True


def partial_products(
    x: Tensor,
    w: Tensor,
    nch: int,
    tiles: tuple[Tensor, Tensor, Tensor] | None = None,
    cfg: lin.TileConfig | None = None,
) -> Partials:
    """The K-chunk products of x (M, K) @ w (N, K).T (w (E, N, K) with `tiles`, rows sorted
    by expert), `nch` chunks, as `linear` computes them (see module doc)."""
    check_device(x, w)
    m, k = x.shape
    n = w.shape[-2]
    assert k % nch == 0
    cfg = cfg or lin.tile_for(n, k, w.dtype)
    grouped = tiles is not None
    if grouped:
        te, tr, tn = tiles
        grid_m = te.shape[0]
        sw_e, sw_n, sw_k = w.stride()
    else:
        te = tr = tn = x  # unused
        grid_m = triton.cdiv(m, cfg.bm)
        sw_e, (sw_n, sw_k) = 0, w.stride()
    grid_n = triton.cdiv(n, cfg.bn)
    split = lin.split_chosen(grid_m * grid_n, nch, x.device)
    p = torch.empty((nch if split else 1), m, n, dtype=torch.float32, device=x.device)
    if m == 0:
        return Partials(p, nch if split else 1)
    bk = lin.chunk_step(k // nch, cfg.bk)
    out = p[0]
    lin._matmul[(grid_m, grid_n, nch if split else 1)](
        x, w, w, out, p, m, n, k, m * n,
        x.stride(0), x.stride(1), sw_e, sw_n, sw_k, out.stride(0), out.stride(1),
        te, tr, tn,
        NCH=nch, GROUPED=grouped, SWIGLU=False, SPLIT=split, BM=cfg.rows_per_tile(grouped),
        BN=cfg.bn, BK=bk,
        EVEN=(k // nch) % bk == 0,
        UPCAST=interpreting(), PRECISION=dot_precision(w.dtype),
        num_warps=cfg.warps, num_stages=cfg.stages, **pdl.launch(x.device),
    )  # fmt: skip
    return Partials(p, nch if split else 1)
