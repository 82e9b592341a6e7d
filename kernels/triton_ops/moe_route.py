"""The MoE's routing and combine without a sort: selection, expert layout, combine.

- `route_fwd`: per token row of router logits (N, E) fp32: scores = sigmoid, the top-k
  experts by (score + selection bias), ties to the lower expert id, in descending order
  (slot j = the j-th best), and gates = the selected scores over their in-order fp32 sum
  (IEEE division): bitwise `normalize_rows(scores.gather(-1, idx))` of `rlsys.kernels`.
  A block of rows per program; the top-k is a rank count over the row's E scores
  (E <= RANK_MAX), exact, so the selection is one function of the scores.
- `expert_layout`: where each (token, slot) goes in rows sorted by expert (stable: by
  token, then slot), without a sort: program e counts the entries of every expert (its
  row base and tile base) and numbers its own entries in order. Also the tile table of
  `triton_ops.linear`'s grouped products (expert, first row, rows per tile; surplus tiles
  0 rows) and the cumulative row counts (the offsets of `torch._grouped_mm`).
  `gather_rows` copies the sorted input rows.
- `combine_fwd`: out = h + (shared + sum_j gates[:, j] * y[pos[:, j]]) in fp32, slots in
  order; bitwise `h + moe_combine(...)` (no FMA contraction: each product and sum rounds as
  the torch expression does), with the grouped output read where the layout put it.
Invariant: a token's values depend on its own row only (its routes, its sorted rows' values,
which the row-invariant grouped products compute whatever else is in the call).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from rlsys.kernels.triton_ops import pdl
from rlsys.kernels.triton_ops.common import check_device, next_pow2
from rlsys.kernels.triton_ops.elementwise import sigmoid
from rlsys.kernels.triton_ops.linear import _tree_of
from rlsys.kernels.triton_ops.partials import Partials

RANK_MAX = 256  # experts a row's rank count holds in registers
ROUTE_ELEMENTS = 4096  # rows x E^2 compared per route program
LAYOUT_CHUNK = 256  # entries per step of the layout scan
COMBINE_ELEMENTS = 1024  # rows x d per combine program (one row at d = 1024: a decode
# batch spreads over as many programs as rows)


@triton.jit
def _route(
    RAW, BIAS, IDX, GATES, n_rows, E, s_raw, s_idx, raw_mn,
    K: tl.constexpr, EP: tl.constexpr, ROWS: tl.constexpr, RAW_NCH: tl.constexpr,
    SCORES: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl.wait_prior(PDL)
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = r < n_rows
    e = tl.arange(0, EP)
    valid = e < E
    m = live[:, None] & valid[None, :]
    raw = _tree_of(RAW, r[:, None].to(tl.int64) * s_raw + e[None, :], raw_mn, m, RAW_NCH)
    pdl.release_next(PDL)
    s = raw if SCORES else sigmoid(raw)  # SCORES: given as `sigmoid_fwd` computes them
    key = s + tl.load(BIAS + e, mask=valid, other=0.0)[None, :]
    key = tl.where(m, key, float("-inf"))
    # rank of expert e in its row: how many valid experts beat it (ties: lower id wins)
    kj = key[:, None, :]  # (ROWS, 1, EP): the challenger e'
    ki = key[:, :, None]  # (ROWS, EP, 1): the expert e
    ids = tl.arange(0, EP)
    beats = (kj > ki) | ((kj == ki) & (ids[None, None, :] < ids[None, :, None]))
    rank = tl.sum((beats & valid[None, None, :]).to(tl.int32), axis=2)  # (ROWS, EP)
    total = tl.zeros([ROWS], tl.float32)
    for j in tl.static_range(K):
        pick = (rank == j) & valid[None, :]
        sj = tl.max(tl.where(pick, s, 0.0), axis=1)
        if j == 0:
            total = sj
        else:
            total = total + sj
    for j in tl.static_range(K):
        pick = (rank == j) & valid[None, :]
        ej = tl.max(tl.where(pick, e[None, :], 0), axis=1)
        sj = tl.max(tl.where(pick, s, 0.0), axis=1)
        tl.store(IDX + r * s_idx + j, ej.to(tl.int64), mask=live)
        tl.store(GATES + r * s_idx + j, tl.math.div_rn(sj, total), mask=live)


def route_fwd(
    raw: Tensor | Partials, bias: Tensor, k: int, scores: bool = False
) -> tuple[Tensor, Tensor]:
    """Router logits (N, E) fp32 (or their unreduced chunk products) -> (expert ids (N, k)
    int64, gates (N, k) fp32). `scores`: `raw` holds the scores already (their sigmoid, as
    `elementwise.sigmoid_fwd` computes it: the same bits as the kernel's own)."""
    if isinstance(raw, Partials):
        src, n, e, stride, nch, mn = raw.p, raw.rows, raw.cols, raw.cols, raw.nch, raw.p[0].numel()
    else:
        assert raw.stride(1) == 1
        src, (n, e), stride, nch, mn = raw, raw.shape, raw.stride(0), 1, 0
    check_device(src, bias)
    assert e <= RANK_MAX
    idx = torch.empty(n, k, dtype=torch.int64, device=src.device)
    gates = torch.empty(n, k, dtype=torch.float32, device=src.device)
    if n:
        ep = next_pow2(e, 2)
        rows = max(1, ROUTE_ELEMENTS // (ep * ep))
        _route[(triton.cdiv(n, rows),)](
            src, bias, idx, gates, n, e, stride, idx.stride(0), mn,
            K=k, EP=ep, ROWS=rows, RAW_NCH=nch, SCORES=scores, enable_fp_fusion=False,
            **pdl.launch(src.device),
        )  # fmt: skip
    return idx, gates


@triton.jit
def _expert_layout(
    FLAT, POS, ORDER, OFFSETS, T_EXPERT, T_ROW0, T_ROWS, n_entries, E, max_tiles,
    EP: tl.constexpr, CH: tl.constexpr, BM: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl.wait_prior(PDL)
    e = tl.program_id(0)
    ids = tl.arange(0, EP)
    c = tl.arange(0, CH)
    hist = tl.zeros([EP], tl.int32)
    for start in range(0, n_entries, CH):
        v = tl.load(FLAT + start + c, mask=start + c < n_entries, other=-1)
        hist += tl.sum((v[:, None] == ids[None, :]).to(tl.int32), axis=0)
    pdl.release_next(PDL)
    below = ids < e
    row_base = tl.sum(tl.where(below, hist, 0), axis=0)
    tile_base = tl.sum(tl.where(below, (hist + BM - 1) // BM, 0), axis=0)
    count = tl.sum(tl.where(ids == e, hist, 0), axis=0)
    running = row_base
    for start in range(0, n_entries, CH):
        i = start + c
        v = tl.load(FLAT + i, mask=i < n_entries, other=-1)
        mine = (v == e).to(tl.int32)
        p = running + tl.cumsum(mine, axis=0) - 1
        tl.store(POS + i, p, mask=mine == 1)
        tl.store(ORDER + p, i, mask=mine == 1)
        running += tl.sum(mine, axis=0)
    tl.store(OFFSETS + e, row_base + count)  # cumulative counts (the grouped GEMMs' offsets)
    n_tiles = (count + BM - 1) // BM
    for t0 in range(0, n_tiles, CH):
        t = t0 + c
        on = t < n_tiles
        tl.store(T_EXPERT + tile_base + t, tl.zeros([CH], tl.int32) + e, mask=on)
        tl.store(T_ROW0 + tile_base + t, row_base + t * BM, mask=on)
        tl.store(T_ROWS + tile_base + t, tl.minimum(count - t * BM, BM), mask=on)
    if e == E - 1:  # surplus tiles of the fixed-size table: no rows
        used = tl.sum((hist + BM - 1) // BM, axis=0)
        for t0 in range(used, max_tiles, CH):
            t = t0 + c
            on = t < max_tiles
            tl.store(T_EXPERT + t, tl.zeros([CH], tl.int32) + e, mask=on)
            tl.store(T_ROW0 + t, tl.zeros([CH], tl.int32) + row_base + count, mask=on)
            tl.store(T_ROWS + t, tl.zeros([CH], tl.int32), mask=on)


def expert_layout(
    idx: Tensor, n_experts: int, max_tiles: int, bm: int
) -> tuple[Tensor, Tensor, Tensor, tuple[Tensor, Tensor, Tensor]]:
    """idx (N, k) expert ids -> (pos (N, k) int32: sorted row of each (token, slot);
    order (N * k,) int32: the flat entry at each sorted row; offsets (E,) int32: the
    cumulative row counts (expert e's rows end at offsets[e]); the tile table (expert,
    first row, rows) of `max_tiles` int32 tiles of `bm` rows)."""
    check_device(idx)
    flat = idx.reshape(-1)
    n = flat.shape[0]
    dev = idx.device
    pos = torch.empty(n, dtype=torch.int32, device=dev)
    order = torch.empty(n, dtype=torch.int32, device=dev)
    offsets = torch.empty(n_experts, dtype=torch.int32, device=dev)
    tiles = tuple(torch.empty(max_tiles, dtype=torch.int32, device=dev) for _ in range(3))
    assert n_experts <= RANK_MAX
    _expert_layout[(n_experts,)](
        flat, pos, order, offsets, *tiles, n, n_experts, max_tiles,
        EP=next_pow2(n_experts, 2), CH=LAYOUT_CHUNK, BM=bm, **pdl.launch(dev),
    )  # fmt: skip
    return pos.view(idx.shape), order, offsets, tiles  # type: ignore[return-value]


@triton.jit
def _gather_rows(
    X, ORDER, Y, d, sx, sy, K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False
):
    pdl.wait_prior(PDL)
    pdl.release_next(PDL)
    p = tl.program_id(0).to(tl.int64)
    src = (tl.load(ORDER + p) // K).to(tl.int64)
    c = tl.arange(0, BLOCK)
    for c0 in range(0, d, BLOCK):
        m = c0 + c < d
        tl.store(Y + p * sy + c0 + c, tl.load(X + src * sx + c0 + c, mask=m), mask=m)


def gather_rows(x: Tensor, order: Tensor, k: int) -> Tensor:
    """x (N, d) -> (N * k, d): row p is x[order[p] // k] (the input of sorted row p)."""
    check_device(x, order)
    out = torch.empty(order.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
    if order.shape[0]:
        assert x.stride(1) == 1
        _gather_rows[(order.shape[0],)](
            x, order, out, x.shape[1], x.stride(0), out.stride(0), K=k,
            BLOCK=min(1024, next_pow2(x.shape[1])), **pdl.launch(x.device),
        )  # fmt: skip
    return out


@triton.jit
def _combine(
    H, Y, POS, GATES, SHARED, OUT, n_rows, d, sh, sy, sp, sg, ss, so, y_mn, s_mn,
    K: tl.constexpr, HAS_SHARED: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
    Y_NCH: tl.constexpr, S_NCH: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl.wait_prior(PDL)
    pdl.release_next(PDL)
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = r < n_rows
    r64 = r.to(tl.int64)
    c = tl.arange(0, BLOCK)
    for c0 in range(0, d, BLOCK):
        m = live[:, None] & (c0 + c < d)[None, :]
        x = combined_rows(
            H, Y, POS, GATES, SHARED, r64, live, c0 + c, m, sh, sy, sp, sg, ss, y_mn, s_mn,
            K, HAS_SHARED, ROWS, BLOCK, Y_NCH, S_NCH,
        )  # fmt: skip
        tl.store(OUT + r64[:, None] * so + c0 + c[None, :], x, mask=m)


@triton.jit
def combined_rows(
    H, Y, POS, GATES, SHARED, r64, live, cols, m, sh, sy, sp, sg, ss, y_mn, s_mn,
    K: tl.constexpr, HAS_SHARED: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
    Y_NCH: tl.constexpr, S_NCH: tl.constexpr,
):  # fmt: skip
    """h + (shared + sum_j gates[:, j] * y[pos[:, j]]) of rows r64, columns `cols` (mask
    m), fp32: the shared expert's tree, then each slot's gate * row in slot order, then h,
    each step rounded as written (launch without FMA contraction)."""
    if HAS_SHARED:
        acc = _tree_of(SHARED, r64[:, None] * ss + cols[None, :], s_mn, m, S_NCH)
    else:
        acc = tl.zeros([ROWS, BLOCK], tl.float32)
    for j in tl.static_range(K):
        p = tl.load(POS + r64 * sp + j, mask=live, other=0).to(tl.int64)
        g = tl.load(GATES + r64 * sg + j, mask=live, other=0.0)
        y = _tree_of(Y, p[:, None] * sy + cols[None, :], y_mn, m, Y_NCH)
        acc = acc + g[:, None] * y.to(tl.float32)
    h = tl.load(H + r64[:, None] * sh + cols[None, :], mask=m, other=0.0)
    return h + acc


def _rows_of(t: Tensor | Partials) -> tuple[Tensor, int, int, int]:
    """(pointer tensor, row stride, chunk count, chunk stride) of a product's rows."""
    if isinstance(t, Partials):
        return t.p, t.cols, t.nch, t.p[0].numel()
    assert t.stride(1) == 1
    return t, t.stride(0), 1, 0


def combine_fwd(
    h: Tensor,
    y_sorted: Tensor | Partials,
    pos: Tensor,
    gates: Tensor,
    shared: Tensor | Partials | None,
) -> Tensor:
    """h (N, d) fp32 + (shared (N, d) fp32 + sum_j gates[:, j] * y_sorted[pos[:, j]]);
    `y_sorted` (N * k, d) fp32 and `shared` may be their products' unreduced chunk
    products (`partials.Partials`)."""
    ys, y_stride, y_nch, y_mn = _rows_of(y_sorted)
    check_device(h, ys, pos, gates)
    n, d = h.shape
    out = torch.empty_like(h)
    if n:
        k = pos.shape[1]
        block = min(1024, next_pow2(d))
        rows = max(1, COMBINE_ELEMENTS // block)
        sp, s_stride, s_nch, s_mn = _rows_of(shared if shared is not None else h)
        assert h.stride(1) == 1
        _combine[(triton.cdiv(n, rows),)](
            h, ys, pos, gates, sp, out, n, d, h.stride(0), y_stride,
            pos.stride(0), gates.stride(0), s_stride, out.stride(0), y_mn, s_mn,
            K=k, HAS_SHARED=shared is not None, BLOCK=block, ROWS=rows, Y_NCH=y_nch,
            S_NCH=s_nch, enable_fp_fusion=False, **pdl.launch(h.device),
        )  # fmt: skip
    return out
