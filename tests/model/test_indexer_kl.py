"""The Triton path's indexer KL (`rlsys.model.indexer_kl`) against the loss written with
plain autograd ops over every block (the reference's formula, per sequence).

The node's backward is hand-written and a chunk scores only the blocks its rows can
select, so both are checked here: loss and both gradients, on sequences whose rows select
padding (-1), rows with a single block (not usable) and rows without mass.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from rlsys.kernels.triton_ops.indexer import Selection
from rlsys.model.indexer_kl import IndexerKL, indexer_kl
from rlsys.model.kv_layout import PackedLayout

B, HKV, IDX, KSEL = 4, 2, 8, 3


def plain_kl(qi: Tensor, bk: Tensor, ids: Tensor, mass: Tensor) -> tuple[Tensor, Tensor]:
    keep = ids >= 0
    scores = torch.einsum("rgd,nd->rgn", qi, bk)
    logits = scores.gather(-1, ids.long().clamp_min(0)).masked_fill(~keep, float("-inf"))
    target = mass.masked_fill(~keep, 0.0)
    total = target.sum(-1, keepdim=True)
    usable = (keep.sum(-1) > 1) & (total.squeeze(-1) > 0)
    target = target / total.clamp_min(1e-30)
    log_pred = torch.log_softmax(logits, dim=-1).masked_fill(~keep, 0.0)
    kl = (target * (torch.log(target.clamp_min(1e-30)) - log_pred)).sum(-1)
    return torch.where(usable, kl, 0.0).sum(), usable.sum().to(kl.dtype)


def causal_selection(n: int, gen: torch.Generator) -> Tensor:
    """(n, HKV, KSEL) ascending complete past blocks per row (-1 padded), as the indexer
    selects them: a row at position p picks among blocks j < p // B."""
    ids = torch.full((n, HKV, KSEL), -1, dtype=torch.int32)
    for p in range(n):
        avail = p // B
        for g in range(HKV):
            pick = torch.randperm(avail, generator=gen)[: min(KSEL, avail)].sort().values
            ids[p, g, : pick.numel()] = pick.to(torch.int32)
    return ids


def sequences(lengths: list[int], seed: int = 0) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    qi = torch.randn(n, HKV, IDX, generator=gen, dtype=torch.float64).float()
    counts = [length // B for length in lengths]
    bk = torch.randn(sum(max(c, 1) for c in counts), IDX, generator=gen)
    ids = torch.cat([causal_selection(length, gen) for length in lengths])
    mass = torch.rand(n, HKV, KSEL, generator=gen)
    mass[5] = 0.0  # a row with no mass: not usable
    rows, row = [], 0
    for length in lengths:
        rows.append((row, length))
        row += length
    layout = PackedLayout(
        seq_lens=lengths,
        kv=None,
        bk=None,
        block_counts=counts,
        rows=rows,  # type: ignore[arg-type]
    )
    return qi, bk, ids, mass, layout


def test_a_chunk_gives_the_plain_loss_and_gradients() -> None:
    qi, bk, ids, mass, _ = sequences([40])
    a_qi, a_bk = qi.clone().requires_grad_(), bk.clone().requires_grad_()
    plan = [(0, 0, ids.shape[0], 0, bk.shape[0])]  # one sequence, one chunk
    s, c = IndexerKL.apply(a_qi, a_bk, ids, mass, plan, 1, "ieee")
    (2.5 * s).sum().backward()
    r_qi, r_bk = qi.clone().requires_grad_(), bk.clone().requires_grad_()
    rs, rc = plain_kl(r_qi, r_bk, ids, mass)
    (2.5 * rs).backward()
    s, c = s[0], c[0]
    assert int(c) == int(rc) and 0 < int(c) < ids.shape[0] * HKV
    torch.testing.assert_close(s, rs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(a_qi.grad, r_qi.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(a_bk.grad, r_bk.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk_rows", [7, 10_000])
def test_the_sequence_loss_over_causal_chunks_is_the_loss_over_every_block(
    chunk_rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    import rlsys.model.indexer_kl as module

    monkeypatch.setattr(module, "KL_ROWS", chunk_rows)
    monkeypatch.setattr(module, "KL_SCORES", 1)
    lengths = [37, 3, 26]  # the second has no complete block
    qi, bk, ids, mass, layout = sequences(lengths, seed=1)
    sel = Selection(ids=ids, bits=torch.zeros(1, 1, 1, dtype=torch.int32))
    a_qi, a_bk = qi.clone().requires_grad_(), bk.clone().requires_grad_()
    loss = indexer_kl(a_qi, a_bk, sel, mass, layout, block=B, dtype=torch.float32)
    loss.backward()
    r_qi, r_bk = qi.clone().requires_grad_(), bk.clone().requires_grad_()
    want = r_qi.new_zeros(())
    start = 0
    for (row, n), count in zip(layout.rows, layout.block_counts, strict=True):
        size = max(count, 1)
        s, c = plain_kl(
            r_qi[row : row + n], r_bk[start : start + size], ids[row : row + n], mass[row : row + n]
        )
        want = want + torch.where(c > 0, s / c.clamp_min(1), 0.0)
        start += size
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(a_qi.grad, r_qi.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(a_bk.grad, r_bk.grad, rtol=1e-5, atol=1e-6)
