"""The split-KV forward (chunks walked in parallel, then merged) against the single walk.

Small softmax chunks (32 positions, two 16-key steps) so that every row's walk crosses
several chunks, some of which a row sees nothing of: the merged output must be the dense
softmax, and a decode row's output and LSE bitwise the same whether its chunks are walked
in parallel or in one walk, and the same as in the whole-sequence prefill.
"""

from __future__ import annotations

import pytest
import torch

from rlsys.kernels.attention_plan import plan_tiles
from tests.kernels.triton_cases import (
    SCALE,
    decode_spans,
    dense_attention,
    paged_case,
    prefill_spans,
    selection_visible,
    window_visible,
)

triton = pytest.importorskip("triton")

from rlsys.kernels.triton_ops.attention_fwd import attention_forward, splits_chunks  # noqa: E402
from rlsys.kernels.triton_ops.indexer import select_blocks, union_steps  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
H, HKV, D, BLK, IDX, KSEL, WINDOW, T, CHUNK = 4, 2, 8, 2, 8, 3, 45, 16, 32
LENGTHS = [40, 7, 70]


def _call(kind, case, q, qi, spans, **kw):  # noqa: ANN001, ANN003, ANN202
    """(out, lse, selection ids or None) of one attention call over `spans`."""
    tiles = plan_tiles(spans, T, DEV)
    if kind == "swa":
        extra, ids = {"window": WINDOW}, None
    else:
        sel = select_blocks(qi, case.block_keys, tiles, case.bk, topk_blocks=KSEL, block=BLK)
        off, steps = union_steps(sel, tiles, block=BLK, step=16)
        extra, ids = {"sparse": (off, steps, sel.bits), "block": BLK}, sel.ids
    out, lse = attention_forward(
        q, case.k, case.v, tiles, case.kv, scale=SCALE, step=16, chunk=CHUNK, **extra, **kw
    )
    return out, lse, ids


@pytest.mark.parametrize("kind", ["swa", "sparse"])
def test_split_chunks_give_the_single_walks_bits(kind: str) -> None:
    case = paged_case(LENGTHS, HKV, D, 32, BLK, IDX, DEV, seed=11)
    spans = prefill_spans(case.lengths)
    n = sum(case.lengths)
    q, qi = torch.randn(n, H, D).to(DEV), torch.randn(n, HKV, IDX).to(DEV)
    full, full_lse, ids = _call(kind, case, q, qi, spans, split=False)
    visible = window_visible(WINDOW) if kind == "swa" else selection_visible(ids, spans, BLK)
    want = dense_attention(case, q, spans, visible, SCALE)
    torch.testing.assert_close(full.cpu(), want, atol=2e-6, rtol=1e-5)
    last = [sp.row + sp.n - 1 for sp in spans]
    dspans = decode_spans(case.lengths)
    assert splits_chunks(plan_tiles(dspans, T, DEV), HKV, CHUNK, 3)  # decode: split
    assert not splits_chunks(plan_tiles(spans, T, DEV), HKV, CHUNK, 3)  # prefill: one walk
    walked, walked_lse, _ = _call(kind, case, q[last], qi[last], dspans, split=False)
    split, split_lse, _ = _call(kind, case, q[last], qi[last], dspans, split=True)
    assert torch.equal(split, walked) and torch.equal(split_lse, walked_lse)
    assert torch.equal(split, full[last]) and torch.equal(split_lse, full_lse[last])
    gate = torch.rand(len(last), H).to(DEV)
    gated_walk, _, _ = _call(kind, case, q[last], qi[last], dspans, split=False, gate=gate)
    gated_split, _, _ = _call(kind, case, q[last], qi[last], dspans, split=True, gate=gate)
    assert torch.equal(gated_split, gated_walk)
    assert torch.equal(gated_split, (full[last] * gate[..., None]).to(full.dtype))


def test_split_in_bf16_gives_the_single_walks_bits() -> None:
    """bf16 operands (the models' dtype): the chunk states stay fp32 in memory."""
    case = paged_case(LENGTHS, HKV, D, 32, BLK, IDX, DEV, dtype=torch.bfloat16, seed=3)
    n = sum(case.lengths)
    q, qi = torch.randn(n, H, D).to(DEV, torch.bfloat16), torch.randn(n, HKV, IDX).to(DEV)
    last = [sp.row + sp.n - 1 for sp in prefill_spans(case.lengths)]
    dspans = decode_spans(case.lengths)
    for kind in ("swa", "sparse"):
        walked, walked_lse, _ = _call(kind, case, q[last], qi[last], dspans, split=False)
        split, split_lse, _ = _call(kind, case, q[last], qi[last], dspans, split=True)
        assert torch.equal(split, walked) and torch.equal(split_lse, walked_lse), kind
