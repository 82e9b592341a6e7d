"""The attention projections' epilogue in one launch: rotary, cache writes, output gate.

Input: one row per token of the fused projection `x @ [wq; wk; wv; wgate].T` (and, for
Sparse GQA, of `x @ [w_index_q; w_index_k].T`) (`rlsys.model.fused_weights`), in the
compute dtype. One program per row:
- q heads rotated at the row's position -> Q (N, H, D);
- k heads rotated, v copied, into pool rows `kv_rows[n]` of the K / V pools (the paged
  cache, or any (R, Hkv, D) tensor);
- the gate columns -> sigmoid -> GATE (N, H) in the compute dtype;
- Sparse GQA (INDEX): index queries (fp32 of the dtype value) rotated -> QI (N, Hkv, IDX)
  fp32, the index key rotated -> row `kv_rows[n]` of the index-key pool; with BLOCK_KEYS,
  the merged key of the block the row's token completes -> row `block_rows[n]` of the
  block-key pool: the in-order fp32 sum of the block's B index keys (the B - 1 earlier ones
  read from `block_token_rows[n]`, the row's own last), divided by B. Rows that complete
  no block point at a scratch block (`rlsys.model.decode_layout`).
Invariant: bitwise the unfused epilogue over the same product (`rope_fwd`, `sigmoid_fwd`,
the pool writes and `sequential_sum(...) / B` of `rlsys.model.triton_attention`): each
value is the same elementwise function of the same inputs (`rotate` and `sigmoid` are
shared, and every launch is without FMA contraction).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from rlsys.kernels.triton_ops import pdl
from rlsys.kernels.triton_ops.common import check_device, next_pow2
from rlsys.kernels.triton_ops.elementwise import sigmoid
from rlsys.kernels.triton_ops.linear import _tree_of
from rlsys.kernels.triton_ops.partials import Partials
from rlsys.kernels.triton_ops.rope import rotate

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _ld(Y, at, mask, mn, NCH: tl.constexpr, YDT: tl.constexpr):
    """The product at `at` as `linear` stores it (in YDT: the tree of NCH chunk products
    `mn` apart, rounded once), in fp32."""
    return _tree_of(Y, at, mn, mask, NCH).to(YDT).to(tl.float32)


@triton.jit
def _rotate_heads(
    Y, at0, mn, pos, inv_ptr, OUT, out_row, out_sh, NH: tl.constexpr, NHP: tl.constexpr,
    D: tl.constexpr, HALFP: tl.constexpr, NCH: tl.constexpr, YDT: tl.constexpr,
):  # fmt: skip
    """Rotate NH heads of width D from element at0 of Y; store them at OUT + out_row."""
    h = tl.arange(0, NHP)
    i = tl.arange(0, HALFP)
    half: tl.constexpr = D // 2
    mask = (h < NH)[:, None] & (i < half)[None, :]
    at = at0 + h[:, None] * D + i[None, :]
    x1 = _ld(Y, at, mask, mn, NCH, YDT)
    x2 = _ld(Y, at + half, mask, mn, NCH, YDT)
    inv = tl.load(inv_ptr + i, mask=i < half, other=0.0)
    y1, y2 = rotate(x1, x2, pos, inv[None, :])
    dst = OUT + out_row + h[:, None] * out_sh + i[None, :]
    tl.store(dst, y1.to(OUT.dtype.element_ty), mask=mask)
    tl.store(dst + half, y2.to(OUT.dtype.element_ty), mask=mask)
    return y1, y2


@triton.jit
def _qkv_post(
    Y, YI, POS, KV_ROWS, INV, INV_I,
    Q, K, V, GATE, QI, IK, BK, BTR, BR,
    sy, syi, sq_n, sq_h, sk_r, sk_h, sg, sqi_n, sqi_h, sik, sbk, sbtr, y_mn, yi_mn,
    K_OFF: tl.constexpr, V_OFF: tl.constexpr, G_OFF: tl.constexpr, QI_OFF: tl.constexpr,
    KI_OFF: tl.constexpr,
    H: tl.constexpr, HP: tl.constexpr, HKV: tl.constexpr, HKVP: tl.constexpr,
    D: tl.constexpr, DP: tl.constexpr, IDX: tl.constexpr, IDXP: tl.constexpr,
    B: tl.constexpr, INDEX: tl.constexpr, BLOCK_KEYS: tl.constexpr,
    Y_NCH: tl.constexpr, YI_NCH: tl.constexpr, YDT: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pdl.wait_prior(PDL)
    pdl.release_next(PDL)
    n = tl.program_id(0).to(tl.int64)
    at = n * sy
    pos = tl.load(POS + n).to(tl.float32)
    kv_row = tl.load(KV_ROWS + n).to(tl.int64)
    _rotate_heads(Y, at, y_mn, pos, INV, Q, n * sq_n, sq_h, H, HP, D, DP // 2, Y_NCH, YDT)
    _rotate_heads(
        Y, at + K_OFF, y_mn, pos, INV, K, kv_row * sk_r, sk_h, HKV, HKVP, D, DP // 2, Y_NCH, YDT
    )
    g = tl.arange(0, HKVP)
    d = tl.arange(0, DP)
    vmask = (g < HKV)[:, None] & (d < D)[None, :]
    v = _ld(Y, at + V_OFF + g[:, None] * D + d[None, :], vmask, y_mn, Y_NCH, YDT)
    tl.store(V + kv_row * sk_r + g[:, None] * sk_h + d[None, :], v.to(V.dtype.element_ty),
             mask=vmask)  # fmt: skip
    h = tl.arange(0, HP)
    gate_x = _ld(Y, at + G_OFF + h, h < H, y_mn, Y_NCH, YDT)
    tl.store(GATE + n * sg + h, sigmoid(gate_x).to(GATE.dtype.element_ty), mask=h < H)
    if INDEX:
        ati = n * syi
        _rotate_heads(YI, ati + QI_OFF, yi_mn, pos, INV_I, QI, n * sqi_n, sqi_h, HKV, HKVP, IDX,
                      IDXP // 2, YI_NCH, YDT)  # fmt: skip
        k1, k2 = _rotate_heads(YI, ati + KI_OFF, yi_mn, pos, INV_I, IK, kv_row * sik, 0, 1, 1,
                               IDX, IDXP // 2, YI_NCH, YDT)  # fmt: skip
        if BLOCK_KEYS:
            # the block's earlier B - 1 keys from the pool, this row's own (the last) from
            # registers: the same in-order fold `sequential_sum` runs over the pool rows
            half: tl.constexpr = IDX // 2
            i = tl.arange(0, IDXP // 2)
            im = i < half
            acc1 = tl.zeros([IDXP // 2], tl.float32)
            acc2 = tl.zeros([IDXP // 2], tl.float32)
            for j in tl.static_range(B - 1):
                r = tl.load(BTR + n * sbtr + j).to(tl.int64)
                a1 = tl.load(IK + r * sik + i, mask=im, other=0.0)
                a2 = tl.load(IK + r * sik + half + i, mask=im, other=0.0)
                if j == 0:
                    acc1, acc2 = a1, a2
                else:
                    acc1, acc2 = acc1 + a1, acc2 + a2
            if B > 1:
                acc1, acc2 = acc1 + tl.reshape(k1, [IDXP // 2]), acc2 + tl.reshape(k2, [IDXP // 2])
            else:
                acc1, acc2 = tl.reshape(k1, [IDXP // 2]), tl.reshape(k2, [IDXP // 2])
            br = tl.load(BR + n).to(tl.int64)
            tl.store(BK + br * sbk + i, tl.math.div_rn(acc1, B * 1.0), mask=im)
            tl.store(BK + br * sbk + half + i, tl.math.div_rn(acc2, B * 1.0), mask=im)


@dataclass(frozen=True)
class IndexOut:
    """Sparse GQA's share of the epilogue: index queries out, keys into their pools."""

    y: Tensor | Partials  # (N, Ni) the index product's rows (or its chunk products)
    offsets: list[int]  # its index-query and index-key columns
    qi: Tensor  # (N, Hkv, IDX) fp32, written
    key_pool: Tensor  # (R, IDX) fp32 index keys
    inv_freq: Tensor  # (IDX / 2,) fp32
    block_keys: Tensor | None = None  # (R / B, IDX) fp32 pool, with block_token_rows/rows
    block_token_rows: Tensor | None = None  # (N, B) int64: the block each row completes
    block_rows: Tensor | None = None  # (N,) int64


def _source(y: Tensor | Partials) -> tuple[Tensor, int, int, int]:
    """(pointer tensor, row stride, chunk count, chunk stride) of a product's rows."""
    if isinstance(y, Partials):
        return y.p, y.cols, y.nch, y.p[0].numel()
    assert y.stride(1) == 1
    return y, y.stride(0), 1, 0


def qkv_post(
    y: Tensor | Partials,
    offsets: list[int],
    positions: Tensor,
    kv_rows: Tensor,
    inv_freq: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    n_heads: int,
    block: int = 1,
    index: IndexOut | None = None,
) -> tuple[Tensor, Tensor]:
    """Fused projection rows y (N, Ntot) -> (q (N, H, D), gate (N, H)) in the pools' dtype;
    k/v (and index keys) written to rows `kv_rows` of their pools (see module doc).
    `offsets`: first column of q, k, v, gate in y. `y` (and `index.y`) may be the product's
    unreduced chunk products (`partials.Partials`): summed and rounded here as `linear`
    would have stored them."""
    src, sy, nch, mn = _source(y)
    check_device(src, positions, kv_rows, k_pool, v_pool)
    n = y.rows if isinstance(y, Partials) else y.shape[0]
    hkv, d = k_pool.shape[1], k_pool.shape[2]
    dtype = k_pool.dtype  # the compute dtype, which the products are stored in
    q = torch.empty(n, n_heads, d, dtype=dtype, device=src.device)
    gate = torch.empty(n, n_heads, dtype=dtype, device=src.device)
    if n == 0:
        return q, gate
    assert k_pool.stride() == v_pool.stride() and k_pool.stride(2) == 1
    assert offsets[0] == 0 and len(offsets) == 4
    idx = index.qi.shape[-1] if index is not None else 2
    isrc, syi, inch, imn = _source(index.y) if index is not None else (src, sy, nch, mn)
    qi = index.qi if index is not None else q
    ik = index.key_pool if index is not None else q
    bk = index.block_keys if index is not None and index.block_keys is not None else None
    btr = index.block_token_rows if bk is not None else kv_rows
    br = index.block_rows if bk is not None else kv_rows
    _qkv_post[(n,)](
        src, isrc, positions, kv_rows, inv_freq, index.inv_freq if index is not None else inv_freq,
        q, k_pool, v_pool, gate, qi, ik, bk if bk is not None else ik, btr, br,
        sy, syi, q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1),
        gate.stride(0), qi.stride(0), qi.stride(1), ik.stride(0),
        bk.stride(0) if bk is not None else 0, btr.stride(0), mn, imn,
        K_OFF=offsets[1], V_OFF=offsets[2], G_OFF=offsets[3],
        QI_OFF=index.offsets[0] if index is not None else 0,
        KI_OFF=index.offsets[1] if index is not None else 0,
        H=n_heads, HP=next_pow2(n_heads, 1), HKV=hkv, HKVP=next_pow2(hkv, 1),
        D=d, DP=next_pow2(d, 2), IDX=idx, IDXP=next_pow2(idx, 2), B=block,
        INDEX=index is not None, BLOCK_KEYS=bk is not None,
        Y_NCH=nch, YI_NCH=inch, YDT=_TL_DTYPES[dtype], enable_fp_fusion=False,
        **pdl.launch(src.device),
    )  # fmt: skip
    return q, gate
