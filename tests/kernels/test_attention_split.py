"""The split-KV forward (chunks walked in parallel, then merged) against the single walk.

Small softmax chunks (32 positions, two 16-key steps; or 16-position chunks, two to an
octave past 64, so that the widening chunks are crossed too) so that every row's walk
crosses several chunks, some of which a row sees nothing of: the merged output must be the
dense softmax, and a decode row's output and LSE bitwise the same whether its chunks are
walked in parallel or in one walk, and the same as in the whole-sequence prefill. The chunk
rule's host and kernel twins agree position by position.
"""

from __future__ import annotations

import functools

import pytest
import torch

from rlsys.kernels.attention_plan import Span, plan_tiles
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

import triton.language as tl  # noqa: E402

from rlsys.kernels.triton_ops import attention_fwd  # noqa: E402
from rlsys.kernels.triton_ops.attention_fwd import (  # noqa: E402
    attention_forward,
    forward_launch,
    one_query_slots,
    splits_chunks,
)
from rlsys.kernels.triton_ops.common import interpreting  # noqa: E402
from rlsys.kernels.triton_ops.indexer import select_blocks, union_steps  # noqa: E402
from rlsys.kernels.triton_ops.softmax_chunks import (  # noqa: E402
    chunk_first,
    chunk_index,
    chunk_of,
    chunk_start,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
H, HKV, D, BLK, IDX, KSEL, WINDOW, T, CHUNK = 4, 2, 8, 2, 8, 3, 45, 16, 32
LENGTHS = [40, 7, 100]


def _call(kind, case, q, qi, spans, chunk=CHUNK, **kw):  # noqa: ANN001, ANN003, ANN202
    """(out, lse, selection ids or None) of one attention call over `spans`."""
    tiles = plan_tiles(spans, T, DEV)
    if kind == "swa":
        extra, ids = {"window": WINDOW}, None
    else:
        sel = select_blocks(qi, case.block_keys, tiles, case.bk, topk_blocks=KSEL, block=BLK)
        off, steps = union_steps(sel, tiles, block=BLK, step=16)
        extra, ids = {"sparse": (off, steps, sel.bits), "block": BLK}, sel.ids
    out, lse = attention_forward(
        q, case.k, case.v, tiles, case.kv, scale=SCALE, step=16, chunk=chunk, **extra, **kw
    )
    return out, lse, ids


@pytest.mark.parametrize(("chunk", "per_octave"), [(CHUNK, 8), (16, 2)])
@pytest.mark.parametrize("kind", ["swa", "sparse"])
def test_split_chunks_give_the_single_walks_bits(
    kind: str, chunk: int, per_octave: int, monkeypatch: pytest.MonkeyPatch, rescale_rule: str
) -> None:
    monkeypatch.setattr(attention_fwd, "CHUNKS_PER_OCTAVE", per_octave)
    case = paged_case(LENGTHS, HKV, D, 32, BLK, IDX, DEV, seed=11)
    spans = prefill_spans(case.lengths)
    n = sum(case.lengths)
    q, qi = torch.randn(n, H, D).to(DEV), torch.randn(n, HKV, IDX).to(DEV)
    call = functools.partial(_call, kind, case, chunk=chunk)
    full, full_lse, ids = call(q, qi, spans, split=False)
    visible = window_visible(WINDOW) if kind == "swa" else selection_visible(ids, spans, BLK)
    want = dense_attention(case, q, spans, visible, SCALE)
    torch.testing.assert_close(full.cpu(), want, atol=2e-6, rtol=1e-5)
    last = [sp.row + sp.n - 1 for sp in spans]
    dspans = decode_spans(case.lengths)
    assert splits_chunks(plan_tiles(dspans, T, DEV), HKV, chunk, 3)  # decode: split
    assert not splits_chunks(plan_tiles(spans, T, DEV), HKV, chunk, 3)  # prefill: one walk
    walked, walked_lse, _ = call(q[last], qi[last], dspans, split=False)
    split, split_lse, _ = call(q[last], qi[last], dspans, split=True)
    assert torch.equal(split, walked) and torch.equal(split_lse, walked_lse)
    assert torch.equal(split, full[last]) and torch.equal(split_lse, full_lse[last])
    gate = torch.rand(len(last), H).to(DEV)
    gated_walk, _, _ = call(q[last], qi[last], dspans, split=False, gate=gate)
    gated_split, _, _ = call(q[last], qi[last], dspans, split=True, gate=gate)
    assert torch.equal(gated_split, gated_walk)
    assert torch.equal(gated_split, (full[last] * gate[..., None]).to(full.dtype))


# Options of the single walk that must not change its bits: the module attribute of each
WALK_VARIANTS = {"paired-steps": "FORWARD_PAIRED_STEPS", "rescale-always": "RESCALE_ON_DEMAND"}


@pytest.mark.parametrize("variant", sorted(WALK_VARIANTS))
@pytest.mark.parametrize(("chunk", "per_octave"), [(CHUNK, 8), (16, 2)])
@pytest.mark.parametrize("kind", ["swa", "sparse"])
def test_walk_variants_give_the_walks_bits(
    kind: str,
    chunk: int,
    per_octave: int,
    variant: str,
    monkeypatch: pytest.MonkeyPatch,
    rescale_rule: str,
) -> None:
    """The single walk folding two steps per loop trip or one (`FORWARD_PAIRED_STEPS`), and
    rescaling every step under the slack rule or on a tile-wide branch
    (`RESCALE_ON_DEMAND`): the module's setting and its opposite give the same bits in
    prefill and decode, with chunks small enough that a pair's second step often turns a
    chunk, and walks of odd and even step counts."""
    monkeypatch.setattr(attention_fwd, "CHUNKS_PER_OCTAVE", per_octave)
    case = paged_case(LENGTHS, HKV, D, 32, BLK, IDX, DEV, seed=13)
    n = sum(case.lengths)
    q, qi = torch.randn(n, H, D).to(DEV), torch.randn(n, HKV, IDX).to(DEV)
    call = functools.partial(_call, kind, case, chunk=chunk, split=False)
    gate = torch.rand(n, H).to(DEV)
    name = WALK_VARIANTS[variant]
    default = getattr(attention_fwd, name)
    if isinstance(default, tl.constexpr):
        if not interpreting():
            pytest.skip("a compile-time global: a compiled kernel cannot change it between calls")
        value = tl.constexpr(not default.value)
    else:
        value = not default
    for spans in (prefill_spans(case.lengths), decode_spans(case.lengths)):
        rows = [r for sp in spans for r in range(sp.row, sp.row + sp.n)]
        monkeypatch.setattr(attention_fwd, name, default)
        one, one_lse, _ = call(q[rows], qi[rows], spans, gate=gate[rows])
        monkeypatch.setattr(attention_fwd, name, value)
        two, two_lse, _ = call(q[rows], qi[rows], spans, gate=gate[rows])
        assert torch.equal(two, one) and torch.equal(two_lse, one_lse)


def test_split_in_bf16_gives_the_single_walks_bits(rescale_rule: str) -> None:
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


@pytest.mark.parametrize("d", [16, 64] if DEV == "cuda" else [16])  # 64: `large`'s
@pytest.mark.parametrize("kind", ["swa", "sparse"])
def test_one_warp_decode_walk_gives_the_whole_tiles_bits(
    kind: str, d: int, monkeypatch: pytest.MonkeyPatch, rescale_rule: str
) -> None:
    """The models' tile (4 heads per KV group, 16 slots: 64 MMA rows, a warp's share 16):
    a decode call's part walk runs one warp's 16 rows, the SUB = 4 slots holding the
    query, at every offset of the query in its tile; bitwise the whole-tile single walk
    and the prefill (bf16, the models' dtype; on the GPU, mma.sync against wgmma)."""
    h, hkv = 16, 4
    lengths = [40, 7, 100, 29, 64, 18, 51, 90]  # last positions: 8 offsets in their tiles
    case = paged_case(lengths, hkv, d, 32, BLK, IDX, DEV, dtype=torch.bfloat16, seed=5)
    n = sum(lengths)
    q = torch.randn(n, h, d).to(DEV, torch.bfloat16)
    qi = torch.randn(n, hkv, IDX).to(DEV)
    spans = prefill_spans(lengths)
    last = [sp.row + sp.n - 1 for sp in spans]
    dspans = decode_spans(lengths)
    monkeypatch.setattr(attention_fwd, "ONE_WARP_MIN_PROGRAMS", 0)  # a small call
    assert one_query_slots(plan_tiles(dspans, T, DEV), h // hkv, 4, 1) == 4
    assert {(n_ - 1) % T % 4 for n_ in lengths} == {0, 1, 2, 3}
    full, full_lse, _ = _call(kind, case, q, qi, spans, split=False)
    walked, walked_lse, _ = _call(kind, case, q[last], qi[last], dspans, split=False)
    split, split_lse, _ = _call(kind, case, q[last], qi[last], dspans, split=True)
    assert torch.equal(split, walked) and torch.equal(split_lse, walked_lse)
    assert torch.equal(split, full[last]) and torch.equal(split_lse, full_lse[last])
    assert forward_launch(d)["num_warps"] == 4  # the whole tile's warps the slots assume


def test_large_one_query_batches_split_when_the_part_walk_runs_on_one_warp(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """256 decode rows at 4K, `large`'s 4 heads per group: 1,024 (tile, group) programs,
    past the split bounds, still split because the part walk runs one warp's rows; not
    with that turned off, nor for tiles holding two queries."""
    tiles = plan_tiles([Span(s, s, 1, 4095) for s in range(256)], 16, "cpu")
    assert one_query_slots(tiles, 4, 4, 1024 * 16) == 4
    assert splits_chunks(tiles, 4, 256, 16, g=4)
    assert not splits_chunks(tiles, 4, 256, 16)  # heads per group unknown: the bounds
    pairs = plan_tiles([Span(s, 2 * s, 2, 4094) for s in range(256)], 16, "cpu")
    assert one_query_slots(pairs, 4, 4, 1024 * 16) == 0
    assert not splits_chunks(pairs, 4, 256, 16, g=4)
    monkeypatch.setattr(attention_fwd, "SPLIT_ONE_WARP", False)
    assert not splits_chunks(tiles, 4, 256, 16, g=4)


@pytest.mark.parametrize(("chunk", "per_octave"), [(256, 8), (16, 2), (32, 1)])
def test_chunk_rule_widens_by_octave_and_its_twins_agree(chunk: int, per_octave: int) -> None:
    """Chunks tile the positions in ascending order, each a power of two at least `chunk`
    wide, flat for 2 * P chunks, then P to an octave; the kernels compute the same."""
    flat = 2 * per_octave
    assert [chunk_start(j, chunk, per_octave) for j in range(flat + 1)] == [
        j * chunk for j in range(flat + 1)
    ]
    for j in range(flat, flat + 4 * per_octave):
        lo, hi = chunk_start(j, chunk, per_octave), chunk_start(j + 1, chunk, per_octave)
        width = hi - lo
        assert width >= chunk and width & (width - 1) == 0 and lo % width == 0
        assert width == 1 << (lo.bit_length() - 1 - per_octave.bit_length() + 1)
        assert chunk_index(lo, chunk, per_octave) == j == chunk_index(hi - 1, chunk, per_octave)
    if (chunk, per_octave) == (256, 8):  # the model's rule: 56 chunks at 128K, 16 at 4K
        assert chunk_index(128 * 1024 - 1, chunk, per_octave) == 55
        assert chunk_index(4095, chunk, per_octave) == 15
    js = torch.arange(0, flat + 8 * per_octave, dtype=torch.int32, device=DEV)
    edges = [chunk_start(j, chunk, per_octave) + e for j in js.tolist()[1:] for e in (-1, 0, 1)]
    pos = torch.tensor([0, 1, *edges], dtype=torch.int32, device=DEV)
    want = torch.tensor([chunk_index(int(p), chunk, per_octave) for p in pos.tolist()])
    want_first = torch.tensor([chunk_start(int(j), chunk, per_octave) for j in js.tolist()])
    got, got_first = torch.empty_like(pos), torch.empty(len(js), dtype=torch.int64, device=DEV)
    logs = {"LOG_CHUNK": chunk.bit_length() - 1, "LOG_PER_OCTAVE": per_octave.bit_length() - 1}
    _chunk_rule_probe[(1,)](pos, got, len(pos), js, got_first, len(js), BLOCK=1024, **logs)
    assert torch.equal(got.cpu().long(), want) and torch.equal(got_first.cpu(), want_first)


@triton.jit
def _chunk_rule_probe(pos, out, n, js, out_first, n_js, BLOCK: tl.constexpr,
                      LOG_CHUNK: tl.constexpr, LOG_PER_OCTAVE: tl.constexpr):  # fmt: skip
    o = tl.arange(0, BLOCK)
    p = tl.load(pos + o, mask=o < n, other=0)
    tl.store(out + o, chunk_of(p, LOG_CHUNK, LOG_PER_OCTAVE), mask=o < n)
    j = tl.load(js + o, mask=o < n_js, other=0)
    tl.store(out_first + o, chunk_first(j, LOG_CHUNK, LOG_PER_OCTAVE), mask=o < n_js)
