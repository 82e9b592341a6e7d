"""Policy-token log-probs from hidden states: LM head + masked log-softmax, in chunks.

The rows are the hidden states that predict the policy tokens only (P rows, not every
position). They go through the final norm, the LM head and the log-softmax `chunk` rows at
a time under activation checkpointing: the forward keeps only each chunk's (c,) results,
and the backward recomputes one chunk's (c, V) logits at a time. So the full (P, V) logits
tensor never exists, forward or backward. `chunk=0` is one unchunked pass (kept for the
benchmark and for small batches).

Numerics (docs/ARCHITECTURE.md, "Numerics"), what keeps staleness-0 log-probs bitwise equal to the
engine's: the logits are `Transformer.head_logits` cast to fp32, i.e. `Transformer.logits`
(row-invariant kernels, so selecting rows changes nothing), then divided by the sampling
temperature (skipped at 1: x / 1 is x), then every id outside the allowed set is filled with -inf, then `kernels.log_softmax`
over the full vocabulary, then a gather. The allowed set of a token is its recorded top-p
candidate set when replay is on and it has one, else the sampleable vocabulary
(`valid_vocab`, default the whole vocabulary). `masked_log_softmax` is that recipe; the
engine's sampler (`rlsys.engine.sampler.sample`) takes the same steps in the same order
with its own code, and the alignment tests hold the two to bitwise equality.

The zero-center projection sits on the raw LM-head output (the compute dtype, bf16 in
production): its gradient has its mean over the allowed set removed (docs/ARCHITECTURE.md,
"Numerics", Replay).

Tensor legend: P policy rows, c chunk rows, V vocabulary, C candidates, d width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from rlsys import kernels
from rlsys.model import Transformer, candidate_mask, zero_center


@dataclass(frozen=True)
class LogProbOptions:
    valid_vocab: int  # ids >= this are never sampled
    temperature: float = 1.0
    replay_candidates: bool = True
    zero_center: bool = True
    chunk: int = 1024  # 0 = unchunked


@dataclass
class PolicyLogProbs:
    logp_P: Tensor  # fp32, with gradient
    entropy_P: Tensor  # fp32, no gradient: entropy of the allowed-set distribution


def allowed_mask(
    candidates_cC: Tensor, has_candidates_c: Tensor, vocab_size: int, valid_vocab: int
) -> Tensor:
    """(c, V) bool: the recorded set where a token has one, else the valid vocabulary."""
    valid = torch.arange(vocab_size, device=candidates_cC.device) < valid_vocab
    mask = valid.expand(has_candidates_c.shape[0], vocab_size)
    if candidates_cC.shape[-1] == 0:  # (no `.any()` test on the rows: a device sync per chunk)
        return mask
    recorded = candidate_mask(candidates_cC, vocab_size)
    return torch.where(has_candidates_c.unsqueeze(-1), recorded, mask)


def masked_log_softmax(logits_cV: Tensor, allowed_cV: Tensor, temperature: float = 1.0) -> Tensor:
    """fp32 log-probs over the allowed ids (-inf elsewhere): the trainer's recipe for a
    sampled token's log-prob (the engine's sampler repeats the same steps)."""
    z = logits_cV.float()
    if temperature != 1.0:
        z = z / temperature
    return kernels.log_softmax(z.masked_fill(~allowed_cV, float("-inf")))


def _chunk_log_probs(
    model: Transformer,
    opts: LogProbOptions,
    h_cd: Tensor,
    targets_c: Tensor,
    candidates_cC: Tensor,
    has_candidates_c: Tensor,
) -> tuple[Tensor, Tensor]:
    allowed = allowed_mask(candidates_cC, has_candidates_c, model.cfg.vocab_size, opts.valid_vocab)
    raw = model.head_logits(h_cd)
    if opts.zero_center:
        raw = zero_center(raw, allowed)
    logp_cV = masked_log_softmax(raw, allowed, opts.temperature)
    logp = logp_cV.gather(-1, targets_c.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = -(logp_cV.exp() * logp_cV.masked_fill(~allowed, 0.0)).sum(-1)
    return logp, entropy


def policy_log_probs(
    model: Transformer,
    h_Pd: Tensor,
    targets_P: Tensor,
    candidates_PC: Tensor,
    has_candidates_P: Tensor,
    opts: LogProbOptions,
) -> PolicyLogProbs:
    """Log-prob of each target (and the entropy of its distribution) from its hidden row."""
    if not opts.replay_candidates:
        has_candidates_P = torch.zeros_like(has_candidates_P)
        candidates_PC = candidates_PC[:, :0]
    n = h_Pd.shape[0]
    chunk = opts.chunk if opts.chunk > 0 else max(n, 1)
    logps, entropies = [], []
    for s in range(0, n, chunk):
        args = (h_Pd[s : s + chunk], targets_P[s : s + chunk])
        args += (candidates_PC[s : s + chunk], has_candidates_P[s : s + chunk])
        if opts.chunk > 0 and torch.is_grad_enabled() and h_Pd.requires_grad:
            logp, ent = checkpoint(_chunk_log_probs, model, opts, *args, use_reentrant=False)
        else:
            logp, ent = _chunk_log_probs(model, opts, *args)
        logps.append(logp)
        entropies.append(ent)
    if not logps:
        empty = h_Pd.new_zeros(0, dtype=torch.float32)
        return PolicyLogProbs(empty, empty)
    return PolicyLogProbs(torch.cat(logps), torch.cat(entropies))
