"""Backward of `attention_fwd` (training only: packed sequences that start at position 0),
and the per-block attention mass that the indexer's KL loss needs.

- `_attn_bwd_dq`: per (query tile, group), the forward's step walk (Sparse GQA: the
  tile's union of blocks, packed two a visit, `attention_pairs`), recomputing
  p = exp2(s - lse); dq = sum_visits dS K. It first makes delta = rowsum(dO * O) of its
  rows and stores it for `_attn_bwd_dkv`, which runs after it.
- `_attn_bwd_dkv`: per (key chunk of a sequence, group), a walk over the query tiles that
  visit that chunk (a window range for SWA, the inverse of the union lists for Sparse GQA);
  dK and dV of a key are written by exactly one program: no atomics, so the backward is
  deterministic run to run. A chunk is the forward's key step, or `dkv_keys` keys (a
  multiple of it: `DKV_KEYS`, else the head dim's timed default `DKV_CHUNKS`, 32 keys at
  64, where it fits the shape; a key's sum runs over the same tiles in the same order at
  any chunk: dK and dV were bitwise the step's where timed): a wider chunk reads each
  visiting tile's Q and dO rows once for more keys, and its dK/dV products have M =
  `dkv_keys` rows (warp-group MMA from 64), at the cost of walking the masked keys of
  tiles that visit only part of it.
- `_block_mass`: per (query tile, group), the main attention's probability mass on each of
  a query's selected blocks, averaged over the group's heads, at the block's slot in the
  query's (ascending) selection. Its product's rows are head-major (h * T + slot, not the
  walks' slot-major rows) on one warp: the head sum adds row tiles a thread already holds,
  and visibility and the stores are per query (T rows), not per (query, head). Sparse
  GQA: it walks the packed blocks too.
Where dK/dV's time goes (Nsight Compute, H100, 32K, head dim 64): L1/shared 84% busy,
tensor pipes 19%; Q and dO are re-read per visiting tile (cp.async, then ldmatrix for
the M = 16 dK/dV products). A walk of one warp a head at a time (transposed products, 889
warp instructions a visit against 4 x 399) was timed no faster (13.70 against 13.90 ms,
the trainer 0.96x) and removed.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from rlsys.kernels.attention_plan import PagedKV, QueryTiles
from rlsys.kernels.host_to_device import index_arrays_on
from rlsys.kernels.sorting import stable_argsort
from rlsys.kernels.triton_ops import pdl
from rlsys.kernels.triton_ops.attention_fwd import (
    LOG2E,
    contiguous_rows,
    key_rows,
    load_keys,
    no_selection,
    query_tile,
    row_visibility,
    sequence_row0,
    step_bounds,
    step_keys,
    tile_rows,
    visible_step,
)
from rlsys.kernels.triton_ops.attention_pairs import packed_visit, union_blocks
from rlsys.kernels.triton_ops.common import dot_precision, interpreting, mma, next_pow2

# Launch options of the backward kernels (trainer only: no engine value to match; any
# choice gives the same values run to run). Block mass: one warp, so the head sum stays in
# a thread (head-major rows; two warps split the heads and sum them through shared memory);
# on the H100 at 32K (`bench_block_mass.py`) the slot-major two-warp kernel took 5.65 / 7.53
# ms at head dim 64 / 128, this one 3.13 / 4.70 (two warps: 9.78 / 11.54).
DQ_LAUNCH: dict[str, int] = {"num_warps": 4, "num_stages": 3}
DKV_LAUNCH: dict[str, int] = {"num_warps": 4, "num_stages": 3}
# dK/dV key chunk: None walks the forward's step (16 keys Sparse GQA, 32 SWA: the program
# timed so far); an int (a multiple of the step, dividing the page, <= 32 blocks) walks
# that many keys per program, with `DKV_WIDE_LAUNCH` (two (chunk, D) fp32 accumulators)
DKV_KEYS: int | None = None
# (sm_90: 64 keys at head dim 128 spill 80 B with 2 stages, none with 1.) Timed on the H200
# at 32K (`bench_attention_walk.py --backward --dkv-keys 0,32,64`, twenty-first session):
# Sparse GQA dK/dV 14.2 ms with the step against 29.0 / 30.3 ms with 32 / 64 keys at head
# dim 64, 22.8 against 62.1 / 45.6 at 128; SWA the same at 32 keys, 2x slower at 64. So the
# step stayed the default, until the launch below was found to be what lost (`DKV_CHUNKS`).
DKV_WIDE_LAUNCH: dict[str, int] = {"num_warps": 8, "num_stages": 1}
# The default chunk and launch by head dim where one was timed faster than the step (with
# `DKV_KEYS` None; a shape it does not fit walks the step). Head dim 64 (`large`), H100,
# thirty-fifth session (`bench_attention_walk.py --backward --dkv-keys 0,32,64
# --dkv-wide-launch ...`): 32 keys on 4 warps with 2 stages, Sparse GQA dK/dV 1.894 -> 1.563
# ms at 8K and 13.79 -> 13.76 at 32K, SWA unchanged (its step is 32 keys), dK and dV bitwise
# the step's (a key's sum over the visiting tiles runs in the same order). On 8 warps with
# 1 stage (the wide launch above) the same chunk took 2.62 ms at 8K (and 29.0 at 32K on the
# H200, twenty-first session). `RLSYS_DKV_CHUNKS=0` walks the step.
DKV_CHUNKS: dict[int, tuple[int, dict[str, int]]] = (
    {64: (32, {"num_warps": 4, "num_stages": 2})}
    if os.environ.get("RLSYS_DKV_CHUNKS", "1") == "1"
    else {}
)
MASS_LAUNCH: dict[str, int] = {"num_warps": 1, "num_stages": 3}
# Sparse GQA dq and block mass over the tile's union of blocks, packed STEP // BLK a
# visit, instead of its aligned steps (`attention_pairs`; `RLSYS_PACKED_DQ=0`: the steps)
PACKED_DQ = os.environ.get("RLSYS_PACKED_DQ", "1") == "1"


@triton.jit
def _load_rows(base, qrow, head, present, stride_n, stride_h, d, D: tl.constexpr):
    return tl.load(
        base + qrow[:, None] * stride_n + head[:, None] * stride_h + d[None, :],
        mask=present[:, None] & (d < D)[None, :],
        other=0.0,
    )


@triton.jit
def _attn_bwd_dq(
    Q, K, V, DO, Out, LSE, DELTA, DQ,
    q_stride_n, q_stride_h, k_stride_r, k_stride_g,
    tile_seq, tile_slot0, tile_lo, tile_hi, tile_row,
    block_table, bt_stride,
    o_stride_n, o_stride_h,
    step_off, step_ids,
    sel_bits, sb_stride_n, sb_stride_g,
    qk_scale, sm_scale, window,
    G: tl.constexpr, T: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
    STEP: tl.constexpr, PAGE: tl.constexpr, BLK: tl.constexpr,
    SPARSE: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    CONTIG: tl.constexpr = False, PDL: tl.constexpr = False, PACKED: tl.constexpr = False,
):  # fmt: skip
    """PACKED (Sparse GQA): step_off / step_ids are the tile's union of blocks
    (`attention_pairs.union_blocks`), STEP // BLK of them a visit (`packed_visit`)."""
    pdl.wait_prior(PDL)
    pdl.release_next(PDL)
    tile, g, seq, lo, hi, qpos, present, qrow, head, d, first, last = query_tile(
        tile_seq, tile_slot0, tile_lo, tile_hi, tile_row, step_off, window, T, G, DP, SPARSE, STEP
    )
    seq_row0 = sequence_row0(block_table, bt_stride, seq, CONTIG)
    q = _load_rows(Q, qrow, head, present, q_stride_n, q_stride_h, d, D)
    do = _load_rows(DO, qrow, head, present, q_stride_n, q_stride_h, d, D)
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    dq = tl.zeros([T * G, DP], tl.float32)
    h_all = G * tl.num_programs(1)
    lse = tl.load(LSE + qrow * h_all + head, mask=present, other=0.0)
    # delta = rowsum(dO * O), made here and stored for the dK/dV walk (which runs after this
    # kernel on the same stream): each (row, head) belongs to exactly one program, so the
    # four eager ops and two fp32 copies of dO and O it took before are one load of O rows
    o = _load_rows(Out, qrow, head, present, o_stride_n, o_stride_h, d, D)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), axis=1)
    tl.store(DELTA + qrow * h_all + head, delta, mask=present)
    for i in range(first, last, STEP // BLK if PACKED else 1):
        if PACKED:
            vis, _, k, v, s = packed_visit(
                i, last, step_ids, q, qk_scale, qpos, present, qrow, lo, hi, g, sel_bits,
                sb_stride_n, sb_stride_g, seq, K, V, k_stride_g, block_table, bt_stride,
                k_stride_r, d, D, STEP, PAGE, BLK, UPCAST, PRECISION, CONTIG, seq_row0,
            )  # fmt: skip
        else:
            vis, k, v, s = visible_step(
                i, q, qk_scale, step_ids, qpos, present, qrow, lo, hi, g, window, sel_bits,
                sb_stride_n, sb_stride_g, seq, K, V, k_stride_g, block_table, bt_stride,
                k_stride_r, d, D, STEP, PAGE, BLK, SPARSE, UPCAST, PRECISION,
                GATHER=not SPARSE, CONTIG=CONTIG, seq_row0=seq_row0,
            )  # fmt: skip
        p = tl.where(vis, tl.exp2(s - lse[:, None]), 0.0)
        dp = mma(do, tl.trans(v), PRECISION, UPCAST)
        ds = p * (dp - delta[:, None])
        dq += mma(ds.to(k.dtype), k, PRECISION, UPCAST)
    tl.store(
        DQ + qrow[:, None] * q_stride_n + head[:, None] * q_stride_h + d[None, :],
        (dq * sm_scale).to(DQ.dtype.element_ty),
        mask=present[:, None] & (d < D)[None, :],
    )


@triton.jit
def _chunk_keys(
    K, V, chunk_seq, chunk_step, seq_len, block_table, bt_stride, k_stride_r, k_stride_g,
    D: tl.constexpr, DP: tl.constexpr, STEP: tl.constexpr, PAGE: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    """A dK/dV program's key chunk (program ids: chunk, group): its sequence, step, key
    positions, which exist, the feature offsets, and its K and V rows of the group."""
    chunk = tl.program_id(0)
    g = tl.program_id(1)
    seq = tl.load(chunk_seq + chunk)
    c = tl.load(chunk_step + chunk)
    kpos = c * STEP + tl.arange(0, STEP)
    kvalid = kpos < tl.load(seq_len + seq)
    d = tl.arange(0, DP)
    k_base = K + g * k_stride_g
    v_base = V + g * k_stride_g
    k = load_keys(k_base, block_table, bt_stride, seq, c, kvalid, k_stride_r, d, D, PAGE, STEP)
    v = load_keys(v_base, block_table, bt_stride, seq, c, kvalid, k_stride_r, d, D, PAGE, STEP)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return chunk, g, seq, c, kpos, kvalid, d, k, v


@triton.jit
def _store_dkv(
    DK, DV, dk, dv, block_table, bt_stride, seq, kpos, kvalid, g, d, k_stride_r, k_stride_g,
    sm_scale, D: tl.constexpr, PAGE: tl.constexpr,
):  # fmt: skip
    """Write a chunk's dK (scaled) and dV rows: each key's by exactly one program."""
    krow = key_rows(block_table, bt_stride, seq, kpos, kvalid, PAGE)
    offs = krow[:, None] * k_stride_r + g * k_stride_g + d[None, :]
    out_mask = kvalid[:, None] & (d < D)[None, :]
    tl.store(DK + offs, (dk * sm_scale).to(DK.dtype.element_ty), mask=out_mask)
    tl.store(DV + offs, dv.to(DV.dtype.element_ty), mask=out_mask)


@triton.jit
def _attn_bwd_dkv(
    Q, K, V, DO, LSE, DELTA, DK, DV,
    q_stride_n, q_stride_h, k_stride_r, k_stride_g,
    tile_seq, tile_slot0, tile_lo, tile_hi, tile_row,
    block_table, bt_stride,
    chunk_seq, chunk_step, seq_len, seq_tile0, seq_ntiles,
    inv_off, inv_tiles,
    sel_bits, sb_stride_n, sb_stride_g,
    qk_scale, sm_scale, window,
    G: tl.constexpr, T: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
    STEP: tl.constexpr, PAGE: tl.constexpr, BLK: tl.constexpr,
    SPARSE: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    pdl.wait_prior(PDL)
    pdl.release_next(PDL)
    chunk, g, seq, c, kpos, kvalid, d, k, v = _chunk_keys(
        K, V, chunk_seq, chunk_step, seq_len, block_table, bt_stride, k_stride_r, k_stride_g,
        D, DP, STEP, PAGE, UPCAST,
    )  # fmt: skip
    hkv = tl.num_programs(1)
    dk = tl.zeros([STEP, DP], tl.float32)
    dv = tl.zeros([STEP, DP], tl.float32)
    if SPARSE:
        first = tl.load(inv_off + chunk * hkv + g)
        last = tl.load(inv_off + chunk * hkv + g + 1)
    else:
        t0 = tl.load(seq_tile0 + seq)
        first = t0 + (c * STEP) // T
        last = t0 + tl.minimum(
            (c * STEP + STEP - 1 + window - 1) // T + 1, tl.load(seq_ntiles + seq)
        )
    for i in range(first, last):
        if SPARSE:
            tile = tl.load(inv_tiles + i)
        else:
            tile = i
        _, lo, hi, r, qpos, present, qrow = tile_rows(
            tile, tile_seq, tile_slot0, tile_lo, tile_hi, tile_row, T, G
        )
        head = g * G + r % G
        q = _load_rows(Q, qrow, head, present, q_stride_n, q_stride_h, d, D)
        do = _load_rows(DO, qrow, head, present, q_stride_n, q_stride_h, d, D)
        if UPCAST:
            q = q.to(tl.float32)
            do = do.to(tl.float32)
        lse = tl.load(LSE + qrow * (G * hkv) + head, mask=present, other=0.0)
        delta = tl.load(DELTA + qrow * (G * hkv) + head, mask=present, other=0.0)
        vis = row_visibility(
            qpos, present, qrow, c * STEP, lo, hi, g, window, sel_bits, sb_stride_n,
            sb_stride_g, SPARSE, BLK, STEP,
        )  # fmt: skip
        vis = vis & kvalid[None, :]
        s = mma(q, tl.trans(k), PRECISION, UPCAST) * qk_scale
        p = tl.where(vis, tl.exp2(s - lse[:, None]), 0.0)
        dv += mma(tl.trans(p.to(do.dtype)), do, PRECISION, UPCAST)
        dp = mma(do, tl.trans(v), PRECISION, UPCAST)
        ds = p * (dp - delta[:, None])
        dk += mma(tl.trans(ds.to(q.dtype)), q, PRECISION, UPCAST)
    _store_dkv(
        DK, DV, dk, dv, block_table, bt_stride, seq, kpos, kvalid, g, d, k_stride_r, k_stride_g,
        sm_scale, D, PAGE,
    )  # fmt: skip


@triton.jit
def _block_mass(
    Q, K, LSE, MASS,
    q_stride_n, q_stride_h, k_stride_r, k_stride_g, m_stride_n, m_stride_g,
    tile_seq, tile_slot0, tile_lo, tile_hi, tile_row,
    block_table, bt_stride,
    step_off, step_ids,
    sel_bits, sb_stride_n, sb_stride_g,
    qk_scale,
    G: tl.constexpr, T: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
    STEP: tl.constexpr, PAGE: tl.constexpr, BLK: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, CONTIG: tl.constexpr = False,
    PDL: tl.constexpr = False, PACKED: tl.constexpr = False,
):  # fmt: skip
    """PACKED: step_off / step_ids are the tile's union of blocks, as `_attn_bwd_dq`'s."""
    pdl.wait_prior(PDL)
    pdl.release_next(PDL)
    tile = tl.program_id(0)
    g = tl.program_id(1)
    # the tile's T slots: a query's position, presence and row (visibility and the stores
    # are per query: every head of the group sees the same keys)
    seq, lo, hi, _, qpos, present, qrow = tile_rows(
        tile, tile_seq, tile_slot0, tile_lo, tile_hi, tile_row, T, 1
    )
    # the product's rows head-major (row h * T + slot): the sum over the group's heads is
    # then over whole MMA row tiles, additions within a thread, not shuffles across lanes
    _, _, _, hr, _, rpresent, rrow = tile_rows(
        tile, tile_seq, tile_slot0, tile_lo, tile_hi, tile_row, T, G, HEAD_MAJOR=True
    )
    head = g * G + hr // T
    d = tl.arange(0, DP)
    first, last = step_bounds(tile, g, lo, hi, step_off, 0, True, STEP)
    seq_row0 = sequence_row0(block_table, bt_stride, seq, CONTIG)
    q = _load_rows(Q, rrow, head, rpresent, q_stride_n, q_stride_h, d, D)
    if UPCAST:
        q = q.to(tl.float32)
    lse = tl.load(LSE + rrow * (G * tl.num_programs(1)) + head, mask=rpresent, other=0.0)
    cursor = tl.zeros([T], tl.int32)  # per slot: selected blocks seen so far
    NB: tl.constexpr = STEP // BLK
    k_base = K + g * k_stride_g
    for i in range(first, last, NB if PACKED else 1):
        if PACKED:
            vis, chosen, k, _values, s = packed_visit(
                i, last, step_ids, q, qk_scale, qpos, present, qrow, lo, hi, g, sel_bits,
                sb_stride_n, sb_stride_g, seq, K, K, k_stride_g, block_table, bt_stride,
                k_stride_r, d, D, STEP, PAGE, BLK, UPCAST, PRECISION, CONTIG, seq_row0,
                VALUES=False,
            )  # fmt: skip
        else:
            c, kpos, vis, kneed = step_keys(
                i, step_ids, qpos, present, qrow, lo, hi, g, 0, sel_bits, sb_stride_n,
                sb_stride_g, True, STEP, BLK,
            )  # fmt: skip
            k = load_keys(
                k_base, block_table, bt_stride, seq, c, kneed, k_stride_r, d, D, PAGE, STEP,
                CONTIG=CONTIG, seq_row0=seq_row0,
            )  # fmt: skip
            if UPCAST:
                k = k.to(tl.float32)
            s = mma(q, tl.trans(k), PRECISION, UPCAST) * qk_scale
            blk = c * NB + tl.arange(0, NB)
            # a step's NB blocks lie in one 32-block word of a query's bitmap (STEP <= 32 BLK)
            word = tl.load(
                sel_bits + qrow * sb_stride_n + g * sb_stride_g + (c * NB) // 32,
                mask=present,
                other=0,
            )
            chosen = (((word[:, None] >> (blk % 32)[None, :]) & 1) == 1) & present[:, None]
        # a key no row of a slot sees is masked after the head sum (exp2 of its score may be
        # inf; the select drops it)
        e = tl.sum(tl.reshape(tl.exp2(s - lse[:, None]), (G, T, STEP)), axis=0)  # (T, STEP)
        per_slot = tl.where(vis, e, 0.0)
        mass = tl.sum(tl.reshape(per_slot, (T, NB, BLK)), axis=2) / G  # (T, NB)
        rank = cursor[:, None] + tl.cumsum(chosen.to(tl.int32), axis=1) - 1
        tl.store(
            MASS + qrow[:, None] * m_stride_n + g * m_stride_g + rank,
            mass,
            mask=chosen,
        )
        cursor += tl.sum(chosen.to(tl.int32), axis=1)


def _common_args(q: Tensor, k: Tensor, tiles: QueryTiles, kv: PagedKV) -> tuple:
    return (
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        tiles.seq, tiles.slot0, tiles.lo, tiles.hi, tiles.row,
        kv.block_table, kv.block_table.stride(0),
    )  # fmt: skip


def attention_backward(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    tiles: QueryTiles,
    kv: PagedKV,
    seq_lens: list[int],
    *,
    scale: float,
    step: int,
    window: int = 0,
    sparse: tuple[Tensor, Tensor, Tensor] | None = None,
    block: int = 1,
    dkv_keys: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv of `attention_forward` for packed sequences starting at position 0.
    `dkv_keys`: keys per dK/dV program (None: `DKV_KEYS`, else the step; module doc)."""
    hkv = k.shape[1]
    g = q.shape[1] // hkv
    do = do.contiguous()
    delta = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)  # (N, H): dq's
    dq = torch.empty_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    step_off, step_ids, bits = sparse if sparse is not None else no_selection(q.device)
    meta = dict(
        G=g, T=tiles.T, D=q.shape[2], DP=next_pow2(q.shape[2]), STEP=step, PAGE=kv.page_size,
        BLK=block, SPARSE=sparse is not None, UPCAST=interpreting(),
        PRECISION=dot_precision(q.dtype),
    )  # fmt: skip
    packed = PACKED_DQ and sparse is not None and step > block
    dq_off, dq_ids = union_blocks(bits, tiles, block=block) if packed else (step_off, step_ids)
    _attn_bwd_dq[(tiles.n_tiles, hkv)](
        q, k, v, do, out, lse, delta, dq, *_common_args(q, k, tiles, kv),
        out.stride(0), out.stride(1), dq_off, dq_ids, bits, bits.stride(0), bits.stride(1),
        scale * LOG2E, scale, window, **meta, CONTIG=contiguous_rows(kv), **DQ_LAUNCH,
        **pdl.launch(q.device), PACKED=packed,
    )  # fmt: skip
    keys, launch = _dkv_chunk(
        dkv_keys or DKV_KEYS, q.shape[2], step, kv.page_size, block, sparse is not None
    )
    chunks = _key_chunks(seq_lens, tiles, keys, q.device)
    inv_off, inv_tiles = (
        _invert_steps(step_off, step_ids, tiles, chunks, hkv, keys // step)
        if sparse is not None
        else (step_off, step_ids)
    )
    _attn_bwd_dkv[(chunks["n"], hkv)](
        q, k, v, do, lse, delta, dk, dv, *_common_args(q, k, tiles, kv),
        chunks["seq"], chunks["step"], chunks["seq_len"], chunks["seq_tile0"], chunks["seq_ntiles"],
        inv_off, inv_tiles, bits, bits.stride(0), bits.stride(1),
        scale * LOG2E, scale, window, **{**meta, "STEP": keys}, **launch, **pdl.launch(q.device),
    )  # fmt: skip
    return dq, dk, dv


def _dkv_chunk(
    asked: int | None, head_dim: int, step: int, page: int, block: int, sparse: bool
) -> tuple[int, dict[str, int]]:
    """The dK/dV key chunk and its launch: `asked` (checked: a bad one is an error), else
    the head dim's timed default (`DKV_CHUNKS`) where it fits the shape, else the step."""
    if asked:
        _check_dkv_keys(asked, step, page, block, sparse)
        return asked, (DKV_LAUNCH if asked == step else DKV_WIDE_LAUNCH)
    keys, launch = DKV_CHUNKS.get(head_dim, (step, DKV_LAUNCH))
    try:
        _check_dkv_keys(keys, step, page, block, sparse)
    except ValueError:
        return step, DKV_LAUNCH
    return keys, (DKV_LAUNCH if keys == step else launch)


def _check_dkv_keys(keys: int, step: int, page: int, block: int, sparse: bool) -> None:
    """A dK/dV chunk lies in one page (one table entry per chunk), is whole steps (the
    inverse lists are built from the forward's steps) and, for Sparse GQA, lies in one
    32-block word of a row's selection bitmap (`row_visibility`)."""
    if keys % step or page % keys or (sparse and keys > 32 * block):
        raise ValueError(
            f"dK/dV chunk of {keys} keys: needs a multiple of the step ({step}) that divides "
            f"the page ({page})"
            + (f" and spans at most 32 blocks ({32 * block})" if sparse else "")
        )


def _key_chunks(seq_lens: list[int], tiles: QueryTiles, step: int, device: torch.device) -> dict:
    """Every (sequence, key step) of a packed batch, and each sequence's tile range.

    The same for every layer of a step (a function of the lengths alone): kept, so a
    step's backward moves them to the device once, without a sync."""
    return _key_chunks_of(tuple(seq_lens), tiles.T, step, str(device))


@functools.lru_cache(maxsize=16)
def _key_chunks_of(seq_lens: tuple[int, ...], T: int, step: int, device: str) -> dict:
    lens = torch.tensor(seq_lens, dtype=torch.int64)
    n_steps = (lens + step - 1) // step
    seq = torch.repeat_interleave(torch.arange(len(seq_lens)), n_steps)
    first = torch.cumsum(n_steps, 0) - n_steps
    stp = torch.arange(int(n_steps.sum())) - first[seq]
    ntiles = (lens + T - 1) // T
    tile0 = torch.cumsum(ntiles, 0) - ntiles
    names = ("seq", "step", "seq_len", "seq_tile0", "seq_ntiles", "chunk0")
    moved = index_arrays_on(device, seq, stp, lens, tile0, ntiles, first)
    return {"n": int(seq.shape[0]), **dict(zip(names, moved, strict=True))}


def _invert_steps(
    step_off: Tensor, step_ids: Tensor, tiles: QueryTiles, chunks: dict, hkv: int, per: int = 1
) -> tuple[Tensor, Tensor]:
    """CSR over (key chunk, group) of the query tiles whose union visits that chunk,
    ascending tile order (a fixed accumulation order for dK/dV), each tile once. A chunk is
    `per` consecutive steps: a tile that visits several of them is listed once (its
    repeats sort next to each other and are moved past every real key, as unused slots
    are).

    Without a device sync: `step_ids` may be longer than its CSR's total (`union_steps`
    sizes it by a bound, so the host never reads the total), so every slot is inverted and
    the slots past the total get a key past every real one, which sorts them last, where
    no offset reaches. Offsets come from searching the sorted keys, not from counting them
    (`bincount` and a `repeat_interleave` by device counts each read a size back)."""
    dev = step_ids.device
    slot = torch.arange(step_ids.shape[0], device=dev)
    owner = torch.searchsorted(step_off.long(), slot, right=True) - 1  # its (tile, group)
    used = slot < step_off[-1]
    owner = torch.where(used, owner, 0)
    tile, g = owner // hkv, owner % hkv
    n_keys = chunks["n"] * hkv
    chunk = chunks["chunk0"][tiles.seq[tile].long()] + step_ids.long() // per
    key = torch.where(used, chunk * hkv + g, n_keys)
    bound = (n_keys + 1) * tiles.n_tiles  # sorted on the narrowest keys that hold it
    order = stable_argsort(key * tiles.n_tiles + tile, bound)
    key, tile = key[order], tile[order]
    if per > 1:  # a tile's second and later visits of one chunk: past every real key
        repeat = torch.zeros_like(used)
        repeat[1:] = (key[1:] == key[:-1]) & (tile[1:] == tile[:-1])
        key = torch.where(repeat, n_keys, key)
        order = stable_argsort(key * tiles.n_tiles + tile, bound)
        key, tile = key[order], tile[order]
    keys = torch.arange(n_keys + 1, device=dev)
    inv_off = torch.searchsorted(key, keys)  # first sorted slot of each key
    return inv_off.to(torch.int32), tile.to(torch.int32)


def block_mass(
    q: Tensor,
    k: Tensor,
    lse: Tensor,
    tiles: QueryTiles,
    kv: PagedKV,
    sparse: tuple[Tensor, Tensor, Tensor],
    topk_blocks: int,
    *,
    scale: float,
    step: int,
    block: int,
) -> Tensor:
    """(N, Hkv, KSEL) fp32: attention mass on each selected block (head mean), 0 padded."""
    hkv = k.shape[1]
    g = q.shape[1] // hkv
    step_off, step_ids, bits = sparse
    mass = torch.zeros(q.shape[0], hkv, topk_blocks, dtype=torch.float32, device=q.device)
    packed = PACKED_DQ and step > block
    if packed:
        # built here and again in the backward's dq: kept from forward to backward, the
        # lists' bound-sized id buffer (134 MB at 32K) would stay alive per Sparse layer
        step_off, step_ids = union_blocks(bits, tiles, block=block)
    _block_mass[(tiles.n_tiles, hkv)](
        q, k, lse, mass,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), mass.stride(0), mass.stride(1),
        tiles.seq, tiles.slot0, tiles.lo, tiles.hi, tiles.row,
        kv.block_table, kv.block_table.stride(0),
        step_off, step_ids, bits, bits.stride(0), bits.stride(1),
        scale * LOG2E,
        G=g, T=tiles.T, D=q.shape[2], DP=next_pow2(q.shape[2]), STEP=step, PAGE=kv.page_size,
        BLK=block, UPCAST=interpreting(), PRECISION=dot_precision(q.dtype),
        CONTIG=contiguous_rows(kv), **MASS_LAUNCH, **pdl.launch(q.device), PACKED=packed,
    )  # fmt: skip
    return mass
