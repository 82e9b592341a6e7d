"""Triton attention kernels against the dense oracle, and their batch invariance.

On a CPU machine these run through Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1), at small shapes; on a GPU machine the same tests run compiled.
"Bitwise" checks compare a token's output computed in different calls: a decode batch of
any composition, a chunked prefill, a whole-sequence prefill, and other page layouts.
"""

from __future__ import annotations

import pytest
import torch

from rlsys.kernels.attention_plan import Span, contiguous_table, plan_tiles
from tests.kernels.triton_cases import (
    SCALE,
    decode_spans,
    dense_attention,
    paged_case,
    prefill_spans,
    reference_selection,
    selection_visible,
    window_visible,
)

triton = pytest.importorskip("triton")

from rlsys.kernels.triton_ops.attention_bwd import attention_backward, block_mass  # noqa: E402
from rlsys.kernels.triton_ops.attention_fwd import attention_forward  # noqa: E402
from rlsys.kernels.triton_ops.indexer import select_blocks, union_steps  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
H, HKV, D, BLK, IDX, KSEL, WINDOW = 4, 2, 8, 2, 8, 3, 12
T = 16  # 16 slots x 2 heads per group = 32 rows


def _swa(case, q, spans, window=WINDOW):  # noqa: ANN001, ANN202
    tiles = plan_tiles(spans, T, DEV)
    return attention_forward(q, case.k, case.v, tiles, case.kv, scale=SCALE, step=16, window=window)


def _sparse(case, q, qi, spans, rank_max=128):  # noqa: ANN001, ANN202
    tiles = plan_tiles(spans, T, DEV)
    sel = select_blocks(
        qi, case.block_keys, tiles, case.bk, topk_blocks=KSEL, block=BLK, rank_max=rank_max
    )
    off, ids = union_steps(sel, tiles, block=BLK, step=16)
    out, lse = attention_forward(
        q,
        case.k,
        case.v,
        tiles,
        case.kv,
        scale=SCALE,
        step=16,
        sparse=(off, ids, sel.bits),
        block=BLK,
    )
    return out, lse, sel, (off, ids, sel.bits), tiles


@pytest.mark.parametrize("page", [32, 64])
def test_swa_forward_matches_the_dense_window(page: int, rescale_rule: str) -> None:
    case = paged_case([40, 7, 70], HKV, D, page, BLK, IDX, DEV, seed=page)
    spans = prefill_spans(case.lengths)
    q = torch.randn(sum(case.lengths), H, D).to(DEV)
    out, _ = _swa(case, q, spans)
    want = dense_attention(case, q, spans, window_visible(WINDOW), SCALE)
    torch.testing.assert_close(out.cpu(), want, atol=2e-6, rtol=1e-5)


def test_swa_token_is_bitwise_the_same_in_decode_chunk_and_prefill(rescale_rule: str) -> None:
    window = 45  # spans several 16-key steps: the step order is what is under test
    case = paged_case([40, 7, 70], HKV, D, 32, BLK, IDX, DEV)
    spans = prefill_spans(case.lengths)
    q = torch.randn(sum(case.lengths), H, D).to(DEV)
    full, _ = _swa(case, q, spans, window)
    last = [sp.row + sp.n - 1 for sp in spans]
    decoded, _ = _swa(case, q[last], decode_spans(case.lengths), window)
    assert torch.equal(decoded, full[last])
    alone, _ = _swa(case, q[last[1] : last[1] + 1], [Span(1, 0, 1, 6)], window)  # batch of one
    assert torch.equal(alone, full[last[1] : last[1] + 1])
    rows = slice(spans[2].row + 13, spans[2].row + 50)
    chunk, _ = _swa(case, q[rows], [Span(2, 0, 37, 13)], window)
    assert torch.equal(chunk, full[rows])
    moved = paged_case([40, 7, 70], HKV, D, 64, BLK, IDX, DEV)  # other pages, same keys
    moved.k, moved.v = _relayout(case, moved, case.k), _relayout(case, moved, case.v)
    again, _ = _swa(moved, q, spans, window)
    assert torch.equal(again, full)


def _relayout(src, dst, pool):  # noqa: ANN001, ANN202
    """The same per-position keys placed at dst's page layout."""
    out = torch.zeros_like(dst.k)
    for s, n in enumerate(src.lengths):
        pos = torch.arange(n)
        from tests.kernels.triton_cases import key_rows

        out[key_rows(dst, s, pos).to(out.device)] = pool[key_rows(src, s, pos).to(pool.device)]
    return out


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("rank_max", [128, 0], ids=["rank", "bisect"])
def test_indexer_selects_the_top_scoring_past_blocks(rank_max: int, ties: bool) -> None:
    case = paged_case([40, 7, 50], HKV, D, 32, BLK, IDX, DEV, seed=3)
    spans = prefill_spans(case.lengths)
    qi = torch.randn(sum(case.lengths), HKV, IDX).to(DEV)
    if ties:  # few distinct integer scores: most of a row ties at the k-th score
        case.block_keys.copy_(case.block_keys.sign())
        qi = (qi > 1.0).float()
    tiles = plan_tiles(spans, T, DEV)
    sel = select_blocks(
        qi, case.block_keys, tiles, case.bk, topk_blocks=KSEL, block=BLK, rank_max=rank_max
    )
    _assert_reference_selection(case, qi, spans, sel)
    # the engine's call (no ids: only the bitmap the attention reads) sets the same bits
    bits_only = select_blocks(
        qi, case.block_keys, tiles, case.bk, topk_blocks=KSEL, block=BLK, rank_max=rank_max,
        ids=False,
    )  # fmt: skip
    assert bits_only.ids is None and torch.equal(bits_only.bits, sel.bits)


def _assert_reference_selection(case, qi, spans, sel) -> None:  # noqa: ANN001
    """Every row's ids and every bit of its bitmap (all words) are the reference top-k."""
    ids, bits = sel.ids.cpu(), sel.bits.cpu()
    for sp in spans:
        for i in range(sp.n):
            for g in range(HKV):
                want = reference_selection(case, qi[sp.row + i], sp.seq, i, g, KSEL, BLK)
                got = [int(b) for b in ids[sp.row + i, g] if b >= 0]
                assert got == want, (sp.seq, i, g)
                words = [int(w) & 0xFFFFFFFF for w in bits[sp.row + i, g]]
                assert [
                    b for b in range(32 * len(words)) if (words[b // 32] >> (b % 32)) & 1
                ] == want


@pytest.mark.parametrize("rank_max", [128, 0], ids=["rank", "bisect"])
def test_indexer_chunks_rank_only_as_far_as_their_queries_reach(
    rank_max: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Score buffers of about one tile: early chunks rank 32 blocks, late ones 128, and a
    row's bitmap words past its chunk's width are written 0 (the tensor is uninitialised)."""
    from rlsys.kernels.triton_ops import indexer

    case = paged_case([150, 30], HKV, D, 160, BLK, IDX, DEV, seed=4)
    spans = prefill_spans(case.lengths)
    qi = torch.randn(sum(case.lengths), HKV, IDX).to(DEV)
    tiles = plan_tiles(spans, T, DEV)
    # freed memory full of -1s, for the allocator to hand to the uninitialised bitmap
    torch.full((sum(case.lengths) * HKV * 8,), -1, dtype=torch.int32, device=DEV)
    monkeypatch.setattr(indexer, "SCORE_CHUNK_BYTES", T * HKV * 128 * 4)
    sel = select_blocks(
        qi, case.block_keys, tiles, case.bk, topk_blocks=KSEL, block=BLK, rank_max=rank_max
    )
    assert sel.bits.shape[-1] == 4  # 128 blocks wide in all
    _assert_reference_selection(case, qi, spans, sel)


def test_sparse_forward_matches_the_dense_selection_and_is_batch_invariant(
    rescale_rule: str,
) -> None:
    case = paged_case([40, 7, 70], HKV, D, 32, BLK, IDX, DEV, seed=5)
    spans = prefill_spans(case.lengths)
    n = sum(case.lengths)
    q, qi = torch.randn(n, H, D).to(DEV), torch.randn(n, HKV, IDX).to(DEV)
    full, _, sel, _, _ = _sparse(case, q, qi, spans)
    want = dense_attention(case, q, spans, selection_visible(sel.ids, spans, BLK), SCALE)
    torch.testing.assert_close(full.cpu(), want, atol=2e-6, rtol=1e-5)
    last = [sp.row + sp.n - 1 for sp in spans]
    decoded, _, dsel, _, _ = _sparse(case, q[last], qi[last], decode_spans(case.lengths))
    assert torch.equal(dsel.ids, sel.ids[last]) and torch.equal(decoded, full[last])
    rows = slice(spans[2].row + 13, spans[2].row + 50)
    chunk, _, _, _, _ = _sparse(case, q[rows], qi[rows], [Span(2, 0, 37, 13)])
    assert torch.equal(chunk, full[rows])


def _packed(lengths, seed):  # noqa: ANN001, ANN202
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    q = torch.randn(n, H, D, generator=g)
    k = torch.randn(n, HKV, D, generator=g)
    v = torch.randn(n, HKV, D, generator=g)
    do = torch.randn(n, H, D, generator=g)
    return [t.to(DEV) for t in (q, k, v, do)]


def _dense_grads(q, k, v, do, lengths, allowed):  # noqa: ANN001, ANN202
    """Autograd through masked dense attention; allowed(row, head, key_row) -> bool."""
    n = q.shape[0]
    mask = torch.zeros(n, H, n, dtype=torch.bool)
    row = 0
    for length in lengths:
        for i in range(length):
            for head in range(H):
                for j in range(i + 1):
                    mask[row + i, head, row + j] = allowed(row + i, i, head, j)
        row += length
    qq, kk, vv = (t.detach().cpu().float().requires_grad_() for t in (q, k, v))
    kh, vh = kk.repeat_interleave(H // HKV, 1), vv.repeat_interleave(H // HKV, 1)
    s = torch.einsum("nhd,mhd->nhm", qq, kh) * SCALE
    p = torch.softmax(s.masked_fill(~mask, float("-inf")), -1)
    out = torch.einsum("nhm,mhd->nhd", p, vh)
    out.backward(do.cpu().float())
    return out.detach(), qq.grad, kk.grad, vv.grad, p.detach()


# (page size, keys per dK/dV program): the forward's 16-key step, and wider chunks that
# span several steps (a tile visiting some of them is walked once, its other keys masked)
DKV_CHUNKS = [(32, None), (32, 32), (64, 64)]


@pytest.mark.parametrize(("page", "dkv_keys"), DKV_CHUNKS, ids=["step", "32-keys", "64-keys"])
@pytest.mark.parametrize("kind", ["swa", "sparse", "sparse-steps"])
def test_backward_matches_autograd_of_the_dense_attention(
    kind: str,
    page: int,
    dkv_keys: int | None,
    rescale_rule: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`sparse`: dq and the block mass walk the tiles' unions of blocks, packed
    (`attention_pairs`); `sparse-steps`: the forward's aligned steps (`PACKED_DQ` off)."""
    from rlsys.kernels.triton_ops import attention_bwd

    if kind == "sparse-steps" and dkv_keys:
        pytest.skip("the dq walks differ in dq alone: one dK/dV chunk is enough")
    monkeypatch.setattr(attention_bwd, "PACKED_DQ", kind == "sparse")
    lengths = [40, 7, 50]
    q, k, v, do = _packed(lengths, seed=11)
    kv = contiguous_table(lengths, page, DEV)
    tiles = plan_tiles(prefill_spans(lengths), T, DEV)
    if kind == "swa":
        kw = {"window": WINDOW}

        def allowed(r: int, i: int, head: int, j: int) -> bool:
            return j > i - WINDOW

    else:
        from rlsys.kernels.attention_plan import PagedKV

        g = torch.Generator().manual_seed(12)
        qi = torch.randn(sum(lengths), HKV, IDX, generator=g).to(DEV)
        bkeys = torch.randn(sum(lengths), IDX, generator=g).to(DEV)
        sel = select_blocks(
            qi,
            bkeys,
            tiles,
            PagedKV(kv.block_table // BLK, page // BLK),
            topk_blocks=KSEL,
            block=BLK,
        )
        off, ids = union_steps(sel, tiles, block=BLK, step=16)
        kw = {"sparse": (off, ids, sel.bits), "block": BLK}
        chosen = sel.ids.cpu()

        def allowed(r: int, i: int, head: int, j: int) -> bool:
            blocks = {int(b) for b in chosen[r, head // (H // HKV)] if b >= 0} | {i // BLK}
            return j // BLK in blocks

    out, lse = attention_forward(q, k, v, tiles, kv, scale=SCALE, step=16, **kw)
    dq, dk, dv = attention_backward(
        do, q, k, v, out, lse, tiles, kv, lengths, scale=SCALE, step=16, dkv_keys=dkv_keys, **kw
    )
    ro, rdq, rdk, rdv, probs = _dense_grads(q, k, v, do, lengths, allowed)
    for got, want in ((out, ro), (dq, rdq), (dk, rdk), (dv, rdv)):
        torch.testing.assert_close(got.cpu(), want, atol=5e-6, rtol=1e-4)
    if kind != "swa":
        mass = block_mass(
            q, k, lse, tiles, kv, kw["sparse"], KSEL, scale=SCALE, step=16, block=BLK
        ).cpu()
        for r in range(0, sum(lengths), 7):
            for grp in range(HKV):
                for slot, b in enumerate(chosen[r, grp].tolist()):
                    if b < 0:
                        continue
                    start = r - _pos_of(r, lengths)
                    heads = slice(grp * (H // HKV), (grp + 1) * (H // HKV))
                    want = probs[r, heads, start + b * BLK : start + (b + 1) * BLK].sum(-1).mean()
                    assert abs(float(want) - float(mass[r, grp, slot])) < 1e-6


def _pos_of(row: int, lengths: list[int]) -> int:
    for length in lengths:
        if row < length:
            return row
        row -= length
    raise AssertionError


@pytest.mark.parametrize(
    ("keys", "page", "sparse", "reason"),
    [(24, 64, False, "multiple of the step"), (64, 32, False, "divides the page"),
     (128, 128, True, "at most 32 blocks")],
)  # fmt: skip
def test_a_dkv_chunk_that_cannot_be_walked_is_refused_by_name(
    keys: int, page: int, sparse: bool, reason: str
) -> None:
    from rlsys.kernels.triton_ops.attention_bwd import _check_dkv_keys

    with pytest.raises(ValueError, match=f"dK/dV chunk of {keys} keys.*{reason}"):
        _check_dkv_keys(keys, 16, page, BLK, sparse)
    _check_dkv_keys(32, 16, 64, BLK, sparse)  # whole steps, in one page, 16 blocks


@pytest.mark.parametrize("kind", ["swa", "sparse"])
def test_contiguous_rows_give_the_page_tables_bits(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A packed K/V (`contiguous_table`) addressed from each sequence's first row
    (`attention_fwd.CONTIGUOUS_ROWS`) gives the page-table walks' bits: forward, dq and
    dK/dV, and the block mass. And the flag is what decides the address: a table whose
    pages are swapped but that claims to be contiguous is read as if it were."""
    from dataclasses import replace

    from rlsys.kernels.attention_plan import PagedKV
    from rlsys.kernels.triton_ops import attention_fwd

    lengths, page = [40, 7, 70], 32
    q, k, v, do = _packed(lengths, seed=21)
    kv = contiguous_table(lengths, page, DEV)
    assert kv.contiguous
    tiles = plan_tiles(prefill_spans(lengths), T, DEV)
    kw: dict = {"window": WINDOW}
    if kind == "sparse":
        g = torch.Generator().manual_seed(22)
        qi = torch.randn(sum(lengths), HKV, IDX, generator=g).to(DEV)
        bkeys = torch.randn(sum(lengths), IDX, generator=g).to(DEV)
        bkt = PagedKV(kv.block_table // BLK, page // BLK)
        sel = select_blocks(qi, bkeys, tiles, bkt, topk_blocks=KSEL, block=BLK)
        off, ids = union_steps(sel, tiles, block=BLK, step=16)
        kw = {"sparse": (off, ids, sel.bits), "block": BLK}

    def everything(
        table: PagedKV, fwd: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> list[torch.Tensor]:
        """Forward, backward and block mass over `table` (the backward and the mass from
        `fwd`'s output and LSE where given, so that each walk is checked on its own)."""
        out, lse = attention_forward(q, k, v, tiles, table, scale=SCALE, step=16, **kw)
        o, s = fwd if fwd is not None else (out, lse)
        grads = attention_backward(do, q, k, v, o, s, tiles, table, lengths, scale=SCALE,
                                   step=16, **kw)  # fmt: skip
        got = [out, lse, *grads]
        if kind == "sparse":
            got.append(
                block_mass(
                    q, k, s, tiles, table, kw["sparse"], KSEL, scale=SCALE, step=16, block=BLK
                )  # fmt: skip
            )
        return got

    monkeypatch.setattr(attention_fwd, "CONTIGUOUS_ROWS", False)
    want = everything(kv)
    monkeypatch.setattr(attention_fwd, "CONTIGUOUS_ROWS", True)
    got = everything(kv)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    # the third sequence's two pages swapped in the table: a paged walk follows the table,
    # a walk told the rows are consecutive does not
    swapped = kv.block_table.clone()
    swapped[2, [0, 1]] = swapped[2, [1, 0]]
    honest = everything(PagedKV(swapped, page))
    lying = everything(replace(PagedKV(swapped, page), contiguous=True), fwd=honest[:2])
    # the forward, dq (dK/dV reads its own keys once, by the table) and the block mass
    # each address keys by the flag
    for i in [0, 2] + ([5] if kind == "sparse" else []):
        assert not torch.equal(honest[i], lying[i]), i


def test_the_dkv_chunk_is_the_head_dims_timed_default_where_it_fits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`attention_bwd.DKV_CHUNKS`: 32 keys on 4 warps / 2 stages at head dim 64 (timed faster
    than the 16-key step), the step where the default does not fit the shape or is off, and
    an asked chunk checked as before."""
    from rlsys.kernels.triton_ops import attention_bwd as ab

    keys, launch = ab._dkv_chunk(None, 64, 16, 64, BLK, sparse=True)
    assert (keys, launch) == (32, {"num_warps": 4, "num_stages": 2})
    assert ab._dkv_chunk(None, 64, 16, 16, BLK, sparse=True) == (16, ab.DKV_LAUNCH)
    assert ab._dkv_chunk(None, 128, 16, 64, BLK, sparse=True) == (16, ab.DKV_LAUNCH)
    assert ab._dkv_chunk(None, 64, 32, 64, BLK, sparse=False) == (32, ab.DKV_LAUNCH)  # SWA
    assert ab._dkv_chunk(64, 64, 16, 64, BLK, sparse=True) == (64, ab.DKV_WIDE_LAUNCH)
    with pytest.raises(ValueError, match="multiple of the step"):
        ab._dkv_chunk(24, 64, 16, 64, BLK, sparse=False)
    monkeypatch.setattr(ab, "DKV_CHUNKS", {})  # RLSYS_DKV_CHUNKS=0
    assert ab._dkv_chunk(None, 64, 16, 64, BLK, sparse=True) == (16, ab.DKV_LAUNCH)
