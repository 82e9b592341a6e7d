"""The indexer's KL loss on the Triton path (training only).

Per (query row, KV group): KL(the main attention's mass on the row's selected blocks, as a
distribution || the index softmax over the same blocks), averaged over the usable rows of a
sequence (two or more selected blocks, some mass), summed over sequences: the reference's
loss (`SparseGQA._indexer_loss`) computed per sequence.

Invariants:
- One autograd node per layer (`IndexerKL`) walking chunks of query rows, with its
  backward written out: the loss's gradient in the logits is `p - target` on a usable row's selected blocks
  and 0 elsewhere, made in the forward and kept (rows x groups x k/B, fp32, with the int32
  block ids: what a checkpointed chunk kept, its ids and target). The
  (rows x groups x blocks) scores are never kept: the forward scores a chunk once, the
  backward runs two products (`dS @ bk`, `dS^T @ qi`) - where a checkpointed chunk scored
  it twice and ran ~80 small ops.
- A chunk scores only the blocks its rows can select (complete blocks before its last
  row's), so a sequence's chunks together score the causal half of (rows x blocks).
- The products run at the index scores' precision (`dot_precision`: tf32 for bf16 and fp16
  models, as the selection scored the blocks; exact fp32 for fp32 models).
- No host read: the usable-row count stays on the device.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from rlsys.kernels.triton_ops.autograd import weight_grad
from rlsys.kernels.triton_ops.common import dot_precision
from rlsys.kernels.triton_ops.indexer import Selection
from rlsys.model.kv_layout import PackedLayout

KL_ROWS = 512  # fewest query rows per chunk of the indexer KL
# scores per chunk (rows x groups x blocks, fp32): chunks widen to this many so that short
# sequences take a few large chunks
KL_SCORES = 2**25


@contextmanager
def fp32_products(precision: str) -> Iterator[None]:
    """CUDA fp32 matmuls inside run at `precision` ("tf32" or "ieee"); restored after.

    The trainer issues products from one thread at a time (the autograd engine runs a
    backward while the caller waits), so the process-wide setting is this block's alone."""
    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    matmul.fp32_precision = precision
    try:
        yield
    finally:
        matmul.fp32_precision = before


def _chunk_forward(
    qi: Tensor, bk: Tensor, ids: Tensor, mass: Tensor, precision: str
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(sum of KL over the chunk's usable rows, their count, the slots' score columns, the
    loss's gradient in the logits per unit upstream gradient) of one chunk (class doc)."""
    keep = ids >= 0
    nb = bk.shape[0]
    with fp32_products(precision):
        scores = torch.matmul(qi, bk.T)  # (r, Hkv, nb)
    logits = scores.gather(-1, ids.long().clamp_min(0)).masked_fill_(~keep, float("-inf"))
    del scores
    target = mass.masked_fill(~keep, 0.0)
    total = target.sum(-1, keepdim=True)
    usable = (keep.sum(-1) > 1) & (total.squeeze(-1) > 0)
    target = target / total.clamp_min(1e-30)
    log_pred = torch.log_softmax(logits, dim=-1).masked_fill_(~keep, 0.0)
    kl = (target * (torch.log(target.clamp_min(1e-30)) - log_pred)).sum(-1)
    # d kl / d logits = softmax - target (the target sums to 1); 0 off the usable rows
    # and on padding slots (exp(0) there is masked by keep)
    grad = (log_pred.exp_() - target).masked_fill_(~(keep & usable[..., None]), 0.0)
    # padding slots point at an extra column, so every row's scatter has unique indices
    slots = torch.where(keep, ids, nb)
    count = usable.sum().to(kl.dtype)
    # where, not kl[usable]: boolean indexing reads the count back to the host (a sync)
    return torch.where(usable, kl, 0.0).sum(), count, slots, grad


def _chunk_backward(
    ds_scale: Tensor, qi: Tensor, bk: Tensor, slots: Tensor, grad: Tensor, precision: str,
    d_qi: Tensor, d_bk: Tensor,
) -> None:  # fmt: skip
    """Write the chunk's query gradient into `d_qi` (its rows) and add its block keys'
    gradient into `d_bk` (its blocks): two products, no full-size temporaries."""
    r, hkv, idx_dim = qi.shape
    nb = bk.shape[0]
    ds = grad.new_zeros(r, hkv, nb + 1).scatter_(-1, slots.long(), grad * ds_scale)[..., :nb]
    ds2 = ds.reshape(r * hkv, nb)
    with fp32_products(precision):
        torch.mm(ds2, bk, out=d_qi.view(r * hkv, idx_dim))
        # split over the rows: one addmm_ reduced all r x Hkv rows in 64 thread blocks
        d_bk.add_(weight_grad(ds2, qi.reshape(r * hkv, idx_dim)))


class IndexerKL(torch.autograd.Function):
    """Every chunk of every sequence of one layer as one node: per sequence (sum of KL over
    its usable rows, their count) (S,) each. `plan` lists the chunks as (sequence, first
    row, end row, first block, blocks). One node, where a node per chunk made autograd
    slice-backward each chunk's gradients into full-size zero tensors and add them up
    (O(rows^2 / chunk) traffic: 3% of the step at 32K); here the backward writes each
    chunk's rows of d qi in place and adds into its blocks of d bk."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, qi: Tensor, bk: Tensor, ids: Tensor, mass: Tensor, plan: list, n_seqs: int,
        precision: str,
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        zero = qi.new_zeros(())
        sums, counts = [zero] * n_seqs, [zero] * n_seqs
        kept: list[Tensor] = []
        for seq, r0, r1, b0, nb in plan:
            s, c, slots, grad = _chunk_forward(
                qi[r0:r1], bk[b0 : b0 + nb], ids[r0:r1], mass[r0:r1], precision
            )
            sums[seq], counts[seq] = sums[seq] + s, counts[seq] + c
            kept += [slots, grad]
        ctx.save_for_backward(qi, bk, *kept)
        ctx.plan, ctx.precision = plan, precision
        count = torch.stack(counts)
        ctx.mark_non_differentiable(count)
        return torch.stack(sums), count

    @staticmethod
    def backward(ctx: Any, d_sums: Tensor, _d_counts: Tensor) -> tuple:  # type: ignore[override]
        qi, bk, *kept = ctx.saved_tensors
        d_qi = torch.zeros(qi.shape, dtype=qi.dtype, device=qi.device)  # rows of no chunk: 0
        d_bk = torch.zeros_like(bk)
        for i, (seq, r0, r1, b0, nb) in enumerate(ctx.plan):
            _chunk_backward(
                d_sums[seq], qi[r0:r1], bk[b0 : b0 + nb], kept[2 * i], kept[2 * i + 1],
                ctx.precision, d_qi[r0:r1], d_bk[b0 : b0 + nb],
            )  # fmt: skip
        return d_qi, d_bk, None, None, None, None, None


def indexer_kl(
    qi: Tensor, bk: Tensor, sel: Selection, mass: Tensor, layout: PackedLayout, *,
    block: int, dtype: torch.dtype,
) -> Tensor:  # fmt: skip
    """Sum over sequences of the mean KL over the sequence's usable rows (module doc).
    `block` is B; `dtype` the model's compute dtype (it sets the products' precision)."""
    sizes = [max(c, 1) for c in layout.block_counts]
    starts = torch.tensor([0, *sizes[:-1]]).cumsum(0)
    plan = []
    for seq, ((row, n), start, size) in enumerate(
        zip(layout.rows, starts.tolist(), sizes, strict=True)
    ):
        rows = max(KL_ROWS, KL_SCORES // (qi.shape[1] * size))
        for r0 in range(row, row + n, rows):
            r1 = min(r0 + rows, row + n)
            # a query at position p selects complete blocks j < p // B: the chunk's last row
            # (position r1 - row - 1) bounds the blocks it can have chosen
            plan.append((seq, r0, r1, start, min(size, max((r1 - row - 1) // block, 1))))
    if not plan:
        return qi.new_zeros(())
    if sel.ids is None:
        raise ValueError("the indexer KL needs the selection's ids: select_blocks(ids=True)")
    sums, counts = IndexerKL.apply(qi, bk, sel.ids, mass, plan, len(sizes), dot_precision(dtype))
    return torch.where(counts > 0, sums / counts.clamp_min(1), 0.0).sum()
