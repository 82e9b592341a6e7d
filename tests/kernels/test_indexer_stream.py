"""The streamed indexer selection (no score buffer) against the buffered one and the fp64
reference: the same ids and every bitmap word, for prefill and decode calls, random and
clustered queries, rows full of ties, and rows long enough for several probe passes.

On the CPU these run through Triton's interpreter at small shapes; on a GPU compiled.
"""

from __future__ import annotations

import pytest
import torch

from rlsys.kernels.attention_plan import plan_tiles
from tests.kernels.triton_cases import decode_spans, paged_case, prefill_spans, reference_selection

pytest.importorskip("triton")

from rlsys.kernels.triton_ops import indexer_stream  # noqa: E402
from rlsys.kernels.triton_ops.indexer import select_blocks  # noqa: E402
from rlsys.kernels.triton_ops.indexer_stream import select_blocks_streamed  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
HKV, D, BLK, IDX, T = 2, 8, 2, 8, 16


def _both(case, qi, spans, ksel):  # noqa: ANN001, ANN202
    """Both selections of the call, and the streamed one's probe passes per tile."""
    tiles = plan_tiles(spans, T, DEV)
    kw = {"topk_blocks": ksel, "block": BLK}
    passes = torch.zeros(tiles.n_tiles, dtype=torch.int32, device=DEV)
    buffered = select_blocks(qi, case.block_keys, tiles, case.bk, **kw)
    streamed = select_blocks_streamed(qi, case.block_keys, tiles, case.bk, passes=passes, **kw)
    return buffered, streamed, passes


def _assert_same(buffered, streamed) -> None:  # noqa: ANN001
    assert torch.equal(streamed.ids, buffered.ids)
    assert torch.equal(streamed.bits, buffered.bits)


@pytest.mark.parametrize(
    ("kind", "collect"),
    [
        ("random", 64), ("clustered", 64), ("ties", 64), ("random", 2), ("ties", 2),
        ("random", 128), ("ties", 128),
    ],
)  # fmt: skip
def test_streamed_selection_is_the_buffered_one(
    kind: str, collect: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With brackets of up to 64 keys collected (what runs); of up to 2 (the probes then
    narrow nearly every row to its k-th key themselves); of up to 128 (no probe pass: every
    row, up to 100 blocks, is collected and ranked whole)."""
    monkeypatch.setattr(indexer_stream, "COLLECT", collect)
    case = paged_case([200, 7, 90], HKV, D, 32, BLK, IDX, DEV, seed=11)
    spans = prefill_spans(case.lengths)
    n = sum(case.lengths)
    g = torch.Generator().manual_seed(5)
    qi = torch.randn(n, HKV, IDX, generator=g)
    if kind == "clustered":  # keys near a few directions, queries near one of them
        centres = torch.randn(4, IDX, generator=g)
        pick = torch.randint(0, 4, (case.block_keys.shape[0],), generator=g)
        case.block_keys.copy_(
            (centres[pick] + 0.1 * torch.randn(case.block_keys.shape, generator=g)).to(DEV)
        )
        qi = centres[torch.randint(0, 4, (n, HKV), generator=g)] + 0.05 * qi
    if kind == "ties":  # few distinct integer scores: most of a row ties at the k-th score
        case.block_keys.copy_(case.block_keys.sign())
        qi = (qi > 1.0).float()
    qi = qi.to(DEV)
    buffered, streamed, passes = _both(case, qi, spans, ksel=9)
    _assert_same(buffered, streamed)
    # rows past k blocks were searched by probes (or, at 128, collected whole)
    assert int(passes.max()) == 0 if collect == 128 else int(passes.max()) >= 1


def test_streamed_selection_matches_the_reference_in_prefill_and_decode() -> None:
    case = paged_case([200, 61], HKV, D, 64, BLK, IDX, DEV, seed=2)
    spans = prefill_spans(case.lengths)
    qi = torch.randn(sum(case.lengths), HKV, IDX).to(DEV)
    _, full, _ = _both(case, qi, spans, ksel=5)
    ids, bits = full.ids.cpu(), full.bits.cpu()
    for sp in spans:
        for i in range(sp.n):
            for grp in range(HKV):
                want = reference_selection(case, qi[sp.row + i], sp.seq, i, grp, 5, BLK)
                assert [int(b) for b in ids[sp.row + i, grp] if b >= 0] == want
                words = [int(w) & 0xFFFFFFFF for w in bits[sp.row + i, grp]]
                assert [b for b in range(32 * len(words)) if words[b // 32] >> (b % 32) & 1] == want
    last = [sp.row + sp.n - 1 for sp in spans]
    dec_buf, dec, _ = _both(case, qi[last], decode_spans(case.lengths), ksel=5)
    _assert_same(dec_buf, dec)
    assert torch.equal(dec.ids, full.ids[last])


def test_bitmap_only_call_sets_the_same_bits_and_every_word() -> None:
    """Without ids, over an uninitialised bitmap: the words past a row's blocks are 0."""
    case = paged_case([150, 30], HKV, D, 160, BLK, IDX, DEV, seed=4)
    spans = prefill_spans(case.lengths)
    qi = torch.randn(sum(case.lengths), HKV, IDX).to(DEV)
    torch.full((sum(case.lengths) * HKV * 8,), -1, dtype=torch.int32, device=DEV)
    tiles = plan_tiles(spans, T, DEV)
    want = select_blocks(qi, case.block_keys, tiles, case.bk, topk_blocks=4, block=BLK)
    got = select_blocks_streamed(
        qi, case.block_keys, tiles, case.bk, topk_blocks=4, block=BLK, ids=False
    )
    assert got.ids is None and torch.equal(got.bits, want.bits)
