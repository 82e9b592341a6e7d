"""Batch-invariant matrix products: `x @ w.T`, its fixed 8-chunk tree form, and the grouped
(per-expert) versions the MoE runs.

Why not cuBLAS: it picks an algorithm (tile, split-K) from the shape, so a token's output
row changes with the number of rows in the batch. Here one program computes one
(BM x BN) output tile with ONE configuration for every M, looping over K in BK steps in
ascending order; an output row therefore depends on its input row and the weights only.
- `linear`: out = x @ w.T, fp32 accumulation, stored in `out_dtype` (w's by default).
- `linear_tree`: the row-parallel form of `rlsys.kernels.tp`: K is cut into NCH equal
  chunks whose fp32 partial products are summed as the balanced tree
  ((p0 + p1) + (p2 + p3)) + ..., so a TP rank owning a subtree of chunks computes that
  subtree's value bitwise (fp32 out).
- Grouped variants take rows sorted by expert and a tile table (tile -> expert, first row,
  rows): w is (E, N, K); one launch for all experts, no Python loop over experts.
Backward passes (training) use plain torch matmuls: training needs no batch invariance.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from rlsys.kernels.triton_ops.common import check_device, dot_precision, interpreting, mma

BM = 64  # rows per tile: fixed for every M (the grouped tile table uses it too)


@dataclass(frozen=True)
class TileConfig:
    """One launch configuration. Chosen from the weight's shape only, never from M: a
    row's reduction (BK steps in order, one MMA shape) must not change with the batch."""

    bn: int = 64
    bk: int = 64
    warps: int = 4
    stages: int = 3


DEFAULT_TILE = TileConfig()
TILES: dict[tuple[int, int], TileConfig] = {}  # (N, K) -> measured best (benchmarks/)


def tile_for(n: int, k: int) -> TileConfig:
    return TILES.get((n, k), DEFAULT_TILE)


@triton.jit
def _chunk_acc(
    x_ptr, w_ptr, rm, rn, m_mask, n_mask, k0, k_len,
    sx_m, sx_k, sw_n, sw_k,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """fp32 (BM, BN) sum over k in [k0, k0 + k_len) of x[rm, k] * w[rn, k], BK at a time."""
    acc = tl.zeros([BM, BN], tl.float32)
    rk = tl.arange(0, BK)
    for kk in range(0, k_len, BK):
        k = k0 + kk + rk
        k_mask = (kk + rk) < k_len
        a = tl.load(
            x_ptr + rm[:, None] * sx_m + k[None, :] * sx_k,
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        b = tl.load(
            w_ptr + rn[:, None] * sw_n + k[None, :] * sw_k,
            mask=n_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        else:
            a = a.to(b.dtype)
        acc += mma(a, tl.trans(b), PRECISION, UPCAST)
    return acc


@triton.jit
def _tree(
    x_ptr, w_ptr, rm, rn, m_mask, n_mask, K,
    sx_m, sx_k, sw_n, sw_k,
    NCH: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """The balanced-tree sum of NCH chunk products (NCH in 1, 2, 4, 8)."""
    size = K // NCH
    p0 = _chunk_acc(
        x_ptr,
        w_ptr,
        rm,
        rn,
        m_mask,
        n_mask,
        0,
        size,
        sx_m,
        sx_k,
        sw_n,
        sw_k,
        BM,
        BN,
        BK,
        UPCAST,
        PRECISION,
    )
    if NCH >= 2:
        p1 = _chunk_acc(
            x_ptr,
            w_ptr,
            rm,
            rn,
            m_mask,
            n_mask,
            size,
            size,
            sx_m,
            sx_k,
            sw_n,
            sw_k,
            BM,
            BN,
            BK,
            UPCAST,
            PRECISION,
        )
        p0 = p0 + p1
    if NCH >= 4:
        p2 = _chunk_acc(
            x_ptr,
            w_ptr,
            rm,
            rn,
            m_mask,
            n_mask,
            2 * size,
            size,
            sx_m,
            sx_k,
            sw_n,
            sw_k,
            BM,
            BN,
            BK,
            UPCAST,
            PRECISION,
        )
        p3 = _chunk_acc(
            x_ptr,
            w_ptr,
            rm,
            rn,
            m_mask,
            n_mask,
            3 * size,
            size,
            sx_m,
            sx_k,
            sw_n,
            sw_k,
            BM,
            BN,
            BK,
            UPCAST,
            PRECISION,
        )
        p0 = p0 + (p2 + p3)
    if NCH >= 8:
        p4 = _chunk_acc(
            x_ptr,
            w_ptr,
            rm,
            rn,
            m_mask,
            n_mask,
            4 * size,
            size,
            sx_m,
            sx_k,
            sw_n,
            sw_k,
            BM,
            BN,
            BK,
            UPCAST,
            PRECISION,
        )
        p5 = _chunk_acc(
            x_ptr,
            w_ptr,
            rm,
            rn,
            m_mask,
            n_mask,
            5 * size,
            size,
            sx_m,
            sx_k,
            sw_n,
            sw_k,
            BM,
            BN,
            BK,
            UPCAST,
            PRECISION,
        )
        p6 = _chunk_acc(
            x_ptr,
            w_ptr,
            rm,
            rn,
            m_mask,
            n_mask,
            6 * size,
            size,
            sx_m,
            sx_k,
            sw_n,
            sw_k,
            BM,
            BN,
            BK,
            UPCAST,
            PRECISION,
        )
        p7 = _chunk_acc(
            x_ptr,
            w_ptr,
            rm,
            rn,
            m_mask,
            n_mask,
            7 * size,
            size,
            sx_m,
            sx_k,
            sw_n,
            sw_k,
            BM,
            BN,
            BK,
            UPCAST,
            PRECISION,
        )
        p0 = p0 + ((p4 + p5) + (p6 + p7))
    return p0


@triton.jit
def _matmul(
    X, W, W3, Y, M, N, K,
    sx_m, sx_k, sw_e, sw_n, sw_k, sy_m, sy_n,
    tile_expert, tile_row0, tile_rows,
    NCH: tl.constexpr, GROUPED: tl.constexpr, SWIGLU: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if GROUPED:
        e = tl.load(tile_expert + pid_m)
        row0 = tl.load(tile_row0 + pid_m)
        rows = tl.load(tile_rows + pid_m)
        w_ptr = W + e.to(tl.int64) * sw_e
        w3_ptr = W3 + e.to(tl.int64) * sw_e
    else:
        row0 = pid_m * BM
        rows = M - row0
        w_ptr = W
        w3_ptr = W3
    rm = (row0 + tl.arange(0, BM)).to(tl.int64)
    rn = pid_n * BN + tl.arange(0, BN)
    m_mask = tl.arange(0, BM) < rows
    n_mask = rn < N
    K = tl.where(rows > 0, K, 0)  # surplus grouped tiles skip the K loop
    if SWIGLU:
        # silu(x w1^T) * (x w3^T) from the fp32 accumulators, rounded once
        a1 = _tree(
            X,
            w_ptr,
            rm,
            rn,
            m_mask,
            n_mask,
            K,
            sx_m,
            sx_k,
            sw_n,
            sw_k,
            1,
            BM,
            BN,
            BK,
            UPCAST,
            PRECISION,
        )
        a3 = _tree(
            X,
            w3_ptr,
            rm,
            rn,
            m_mask,
            n_mask,
            K,
            sx_m,
            sx_k,
            sw_n,
            sw_k,
            1,
            BM,
            BN,
            BK,
            UPCAST,
            PRECISION,
        )
        acc = a1 / (1.0 + tl.exp(-a1)) * a3
    else:
        acc = _tree(
            X,
            w_ptr,
            rm,
            rn,
            m_mask,
            n_mask,
            K,
            sx_m,
            sx_k,
            sw_n,
            sw_k,
            NCH,
            BM,
            BN,
            BK,
            UPCAST,
            PRECISION,
        )
    tl.store(
        Y + rm[:, None] * sy_m + rn[None, :] * sy_n,
        acc.to(Y.dtype.element_ty),
        mask=m_mask[:, None] & n_mask[None, :],
    )


def _launch(
    x: Tensor,
    w: Tensor,
    w3: Tensor | None,
    out: Tensor,
    n: int,
    nch: int,
    tiles: tuple[Tensor, Tensor, Tensor] | None,
    swiglu: bool,
    cfg: TileConfig | None = None,
) -> Tensor:
    check_device(x, w)
    k_dim = x.shape[1]
    cfg = cfg or tile_for(n, k_dim)
    m, k = x.shape
    assert k % nch == 0
    if m == 0:
        return out
    grouped = tiles is not None
    if grouped:
        te, tr, tn = tiles
        grid_m = te.shape[0]
        sw_e, sw_n, sw_k = w.stride()
        assert w3 is None or w3.stride() == w.stride()
    else:
        te = tr = tn = x  # unused
        grid_m = triton.cdiv(m, BM)
        sw_e, (sw_n, sw_k) = 0, w.stride()
    _matmul[(grid_m, triton.cdiv(n, cfg.bn))](
        x, w, w3 if w3 is not None else w, out, m, n, k,
        x.stride(0), x.stride(1), sw_e, sw_n, sw_k, out.stride(0), out.stride(1),
        te, tr, tn,
        NCH=nch, GROUPED=grouped, SWIGLU=swiglu, BM=BM, BN=cfg.bn, BK=cfg.bk,
        UPCAST=interpreting(), PRECISION=dot_precision(w.dtype),
        num_warps=cfg.warps, num_stages=cfg.stages,
    )  # fmt: skip
    return out


def linear_fwd(
    x: Tensor, w: Tensor, out_dtype: torch.dtype | None = None, cfg: TileConfig | None = None
) -> Tensor:
    """x (M, K) @ w (N, K).T -> (M, N) in `out_dtype` (default w's)."""
    out = torch.empty(x.shape[0], w.shape[0], dtype=out_dtype or w.dtype, device=x.device)
    return _launch(x, w, None, out, w.shape[0], 1, None, False, cfg)


def linear_tree_fwd(x: Tensor, w: Tensor, n_chunks: int) -> Tensor:
    """fp32 balanced-tree sum of `n_chunks` K-chunk products of x @ w.T."""
    out = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32, device=x.device)
    return _launch(x, w, None, out, w.shape[0], n_chunks, None, False)


def expert_tiles(counts: Tensor, max_tiles: int) -> tuple[Tensor, Tensor, Tensor]:
    """Tile table for rows sorted by expert: per tile (expert, first row, rows in tile).

    `max_tiles` >= cdiv(total, BM) + E bounds the grid without reading counts on the host
    (no device sync); surplus tiles get 0 rows and write nothing.
    """
    dev = counts.device
    per_expert = (counts + BM - 1) // BM
    tile_end = torch.cumsum(per_expert, 0)  # first tile of the next expert
    first_row = torch.cumsum(counts, 0) - counts
    idx = torch.arange(max_tiles, device=dev)
    expert = torch.searchsorted(tile_end, idx, right=True).clamp_max(counts.shape[0] - 1)
    j = idx - (tile_end - per_expert)[expert]
    rows = torch.clamp(counts[expert] - j * BM, min=0, max=BM)
    rows = torch.where(idx < tile_end[-1], rows, 0)
    row0 = first_row[expert] + j * BM
    return expert.to(torch.int32), row0.to(torch.int32), rows.to(torch.int32)


def swiglu_fwd(
    x: Tensor, w1: Tensor, w3: Tensor, tiles: tuple[Tensor, Tensor, Tensor] | None = None
) -> Tensor:
    """silu(x w1^T) * (x w3^T) -> (rows, H) in w's dtype; w1/w3 (H, K), or (E, H, K) with
    `tiles` for rows sorted by expert."""
    h = w1.shape[-2]
    out = torch.empty(x.shape[0], h, dtype=w1.dtype, device=x.device)
    return _launch(x, w1, w3, out, h, 1, tiles, True)


def grouped_tree_fwd(
    h_sorted: Tensor, w2: Tensor, tiles: tuple[Tensor, Tensor, Tensor], n_chunks: int
) -> Tensor:
    """Per expert fp32 tree product h @ w2[e].T; w2 (E, N, K)."""
    out = torch.empty(h_sorted.shape[0], w2.shape[1], dtype=torch.float32, device=h_sorted.device)
    return _launch(h_sorted, w2, None, out, w2.shape[1], n_chunks, tiles, False)
