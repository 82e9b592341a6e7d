"""The MTP heads' training loss: cross-entropy of head d's prediction of token t + 1 + d.

Which targets: the policy tokens only, in the warm start and in RL alike. The heads exist
to draft the policy's own next tokens for speculative decoding, so what they must predict
is what the policy samples; prompt, observation and tool-output tokens come from the
environment and are never drafted (they are still context: the heads' attention runs over
every row). It also keeps the loss's rows those of the main head (P, not N).

Head d's row r predicts the token at row r + 1 + d of its segment. A policy token at row
p is predicted by the main head from row p - 1 (`pred_rows_P`), so by head d from row
p - 1 - d, when that row is still in the segment.

What it trains: only the MTP heads' own parameters. The trunk's hidden states, the
embedding and the LM head (shared with the main head) enter detached, so the policy's
gradient is the RL objective's alone whatever `mtp_weight` is: the heads learn to predict
the policy without pulling it toward its own samples (an SFT term on on-policy data would
bias the policy gradient), and the staleness-0 log-probs are untouched. The trainer clips
the heads' gradient norm apart from the policy's for the same reason.

Memory: head logits go through the LM head in checkpointed chunks of `chunk` rows, as the
main head's do (`logprobs.py`): the (P, V) logits never exist at once.

Tensor legend: N packed rows, P policy tokens, p valid rows of one depth, V vocabulary.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from rlsys import kernels
from rlsys.kernels.host_to_device import moved_without_sync
from rlsys.model import Transformer
from rlsys.model.attention import SeqSpan
from rlsys.trainer.batch import PackedBatch
from rlsys.trainer.fsdp import clip_grad_norm


def _span_bounds(batch: PackedBatch) -> tuple[Tensor, Tensor]:
    """(N,) int64 each: the first row of each row's segment, and one past its last row."""
    starts = torch.empty(batch.num_tokens, dtype=torch.int64)
    ends = torch.empty(batch.num_tokens, dtype=torch.int64)
    for row, n in batch.spans:
        starts[row : row + n], ends[row : row + n] = row, row + n
    device = batch.tokens_N.device
    return moved_without_sync(starts, device), moved_without_sync(ends, device)


def _shifted_tokens(batch: PackedBatch, depth: int, ends: Tensor) -> Tensor:
    """(N,) the token `depth` rows ahead in the same segment (0 past its end: no target)."""
    ahead = torch.arange(batch.num_tokens, device=ends.device) + depth
    tokens = batch.tokens_N[ahead.clamp_max(batch.num_tokens - 1)]
    return torch.where(ahead < ends, tokens, 0)


def _chunk_nll(lm_head: Tensor, normed_pd: Tensor, targets_p: Tensor, valid_vocab: int) -> Tensor:
    logits = kernels.linear(normed_pd, lm_head).float()[:, :valid_vocab]
    logp = kernels.log_softmax(logits)
    return -logp.gather(-1, targets_p.unsqueeze(-1)).squeeze(-1)


def mtp_nll(
    model: Transformer, h_Nd: Tensor, batch: PackedBatch, valid_vocab: int, chunk: int = 1024
) -> list[tuple[Tensor, Tensor]]:
    """Per MTP depth: (NLL (P,) fp32 of every policy token, which of them the depth can
    predict (P,) bool). A token the depth cannot predict (its row would be before its
    segment) is scored from its segment's first row instead and masked out: no
    data-dependent size, so no read of a device value (`nonzero` would wait for the GPU)."""
    if not len(model.mtp) or batch.num_policy_tokens == 0:
        return []
    starts, ends = _span_bounds(batch)
    spans = [SeqSpan(row, n, 0) for row, n in batch.spans]
    positions = torch.cat([torch.arange(n, device=h_Nd.device) for _, n in batch.spans])
    lm_head, embed = model.lm_head.detach(), model.embed.detach()
    h_prev, out = h_Nd.detach(), []
    n_p = batch.num_policy_tokens
    step = chunk if chunk > 0 else n_p
    for depth, head in enumerate(model.mtp, start=1):
        shifted = _shifted_tokens(batch, depth, ends)
        h_prev, normed = head(h_prev, embed[shifted].float(), positions, spans)
        rows = batch.pred_rows_P - depth
        first = starts[batch.pred_rows_P]
        valid_P = rows >= first
        normed_pd = normed[torch.where(valid_P, rows, first)]
        parts = []
        for s in range(0, n_p, step):
            args = (lm_head, normed_pd[s : s + step], batch.targets_P[s : s + step], valid_vocab)
            if chunk > 0 and torch.is_grad_enabled():
                parts.append(checkpoint(_chunk_nll, *args, use_reentrant=False))
            else:
                parts.append(_chunk_nll(*args))
        out.append((torch.cat(parts), valid_P))
    return out


def mtp_loss(per_depth: list[tuple[Tensor, Tensor]], w_P: Tensor | None = None) -> Tensor | None:
    """Mean over the depths that have a target of each depth's NLL over the tokens it can
    predict, weighted by the policy tokens' weights `w_P` (the step's aggregation weights,
    so the loss does not depend on the micro-batch split) or, without weights, averaged
    over those tokens. None without MTP depths; computed on the device (no read)."""
    if not per_depth:
        return None
    terms, has_target = [], []
    for nll, valid in per_depth:
        if w_P is None:
            count = valid.sum()
            term = torch.where(valid, nll, 0.0).sum() / count.clamp_min(1)
        else:
            term = torch.where(valid, nll * w_P, 0.0).sum()
        terms.append(term)
        has_target.append(valid.any())
    has = torch.stack(has_target)
    return torch.stack(terms).sum() / has.sum().clamp_min(1)


def clip_policy_and_mtp(model: Transformer, max_norm: float, sharded: bool = False) -> Tensor:
    """Clip the policy's gradient norm and the MTP heads' apart; returns the policy's.

    One global clip would let the heads' gradient scale the policy's update. `sharded`:
    FSDP2 gradients, whose norm is reduced over ranks first (`fsdp.clip_grad_norm`)."""
    clip = clip_grad_norm if sharded else torch.nn.utils.clip_grad_norm_
    heads = {id(p) for p in model.mtp.parameters()}
    policy = [p for p in model.parameters() if id(p) not in heads]
    norm = clip(policy, max_norm)
    if len(model.mtp):
        clip(list(model.mtp.parameters()), max_norm)
    return norm
