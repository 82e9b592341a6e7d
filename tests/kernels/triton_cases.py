"""Cases for the Triton kernel tests: random paged layouts and dense-math oracles.

The oracle of an attention call is the plain softmax over exactly the keys a query may see
(its window, or its selected blocks plus its own block), one query at a time in fp32: the
simplest statement of what the kernels must compute, whatever their tiling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from rlsys.kernels.attention_plan import PagedKV, Span, plan_tiles


@dataclass
class PagedCase:
    """Sequences whose keys live in a shuffled page pool."""

    lengths: list[int]
    k: Tensor  # (R, Hkv, D)
    v: Tensor
    kv: PagedKV
    block_keys: Tensor  # (R / B, IDX)
    bk: PagedKV


def paged_case(
    lengths: list[int], hkv: int, d: int, page: int, block: int, idx: int, device: str,
    dtype: torch.dtype = torch.float32, seed: int = 0, spare_pages: int = 3,
    spike_every: int = 8, spike: float = 4.0,
) -> PagedCase:  # fmt: skip
    """`spike_every`: about one key row in that many is scaled by `spike`, so a query's
    scores jump well past their running maximum mid-walk, as they do in a trained model:
    the forward's rescale (`fold_step`) runs only then, and only some rows of a tile need
    it (0: no spikes)."""
    g = torch.Generator().manual_seed(seed)
    n_pages = sum(-(-n // page) for n in lengths) + spare_pages
    order = torch.randperm(n_pages, generator=g).tolist()
    width = max(-(-n // page) for n in lengths)
    table = torch.zeros(len(lengths), width, dtype=torch.int32)
    it = iter(order)
    for s, n in enumerate(lengths):
        for p in range(-(-n // page)):
            table[s, p] = next(it) * page
    rows = n_pages * page
    k = torch.randn(rows, hkv, d, generator=g)
    if spike_every:
        k[torch.randint(0, spike_every, (rows,), generator=g) == 0] *= spike
    k = k.to(dtype)
    v = torch.randn(rows, hkv, d, generator=g).to(dtype)
    # Rows that hold no written position (spare pages, the ends of last pages) are NaN, as a
    # freed page may hold anything: a kernel that reads one (a key past the tile's end, a
    # page past the sequence) turns an output into NaN, even where a mask zeroes its weight.
    written = torch.zeros(rows, dtype=torch.bool)
    for s, n in enumerate(lengths):
        pos = torch.arange(n)
        written[table[s, pos // page].long() + pos % page] = True
    k[~written] = float("nan")
    v[~written] = float("nan")
    bkeys = torch.randn(rows // block, idx, generator=g)
    return PagedCase(
        lengths,
        k.to(device),
        v.to(device),
        PagedKV(table.to(device), page),
        bkeys.to(device),
        PagedKV((table // block).to(device), page // block),
    )


def prefill_spans(lengths: list[int]) -> list[Span]:
    spans, row = [], 0
    for s, n in enumerate(lengths):
        spans.append(Span(s, row, n, 0))
        row += n
    return spans


def key_rows(case: PagedCase, seq: int, positions: Tensor) -> Tensor:
    table = case.kv.block_table.cpu()
    return table[seq, positions // case.kv.page_size].long() + positions % case.kv.page_size


def dense_attention(
    case: PagedCase,
    q: Tensor,
    spans: list[Span],
    visible,
    scale: float,  # noqa: ANN001
) -> Tensor:
    """Oracle: out (N, H, D) fp32; `visible(seq, pos, group) -> list of key positions`."""
    h, hkv = q.shape[1], case.k.shape[1]
    qc, kc, vc = q.float().cpu(), case.k.float().cpu(), case.v.float().cpu()
    out = torch.zeros(q.shape, dtype=torch.float32)
    for sp in spans:
        for i in range(sp.n):
            for head in range(h):
                grp = head // (h // hkv)
                kp = torch.tensor(visible(sp.seq, sp.pos + i, grp), dtype=torch.int64)
                rows = key_rows(case, sp.seq, kp)
                s = qc[sp.row + i, head] @ kc[rows, grp].T * scale
                out[sp.row + i, head] = torch.softmax(s, 0) @ vc[rows, grp]
    return out


def window_visible(window: int):  # noqa: ANN201
    def visible(seq: int, pos: int, grp: int) -> list[int]:
        return [p for p in range(max(0, pos - window + 1), pos + 1)]

    return visible


def selection_visible(ids: Tensor, spans: list[Span], block: int):  # noqa: ANN201
    """Keys of a query's selected blocks plus its own block, from `Selection.ids`."""
    by_seq_pos = {}
    ids_c = ids.cpu()
    for sp in spans:
        for i in range(sp.n):
            by_seq_pos[(sp.seq, sp.pos + i)] = sp.row + i

    def visible(seq: int, pos: int, grp: int) -> list[int]:
        row = by_seq_pos[(seq, pos)]
        blocks = {int(b) for b in ids_c[row, grp] if b >= 0} | {pos // block}
        return [p for p in range(pos + 1) if p // block in blocks]

    return visible


def reference_selection(
    case: PagedCase, qi: Tensor, seq: int, pos: int, grp: int, topk: int, block: int
) -> list[int]:
    """Top-`topk` complete past blocks by fp32 score, ascending (ties: lower id)."""
    n_past = pos // block
    if n_past == 0:
        return []
    blocks = torch.arange(n_past)
    table = case.bk.block_table.cpu()
    rows = table[seq, blocks // case.bk.page_size].long() + blocks % case.bk.page_size
    scores = (case.block_keys.cpu()[rows].double() @ qi.cpu()[grp].double()).tolist()
    order = sorted(range(n_past), key=lambda b: (-scores[b], b))
    return sorted(order[:topk])


def decode_spans(lengths: list[int]) -> list[Span]:
    """The last token of every sequence as one decode batch."""
    return [Span(s, i, 1, n - 1) for i, (s, n) in enumerate(enumerate(lengths))]


def tiles_for(spans: list[Span], t: int, device: str):  # noqa: ANN201
    return plan_tiles(spans, t, device)


SCALE = 1.0 / math.sqrt(8)
