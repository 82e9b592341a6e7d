"""Sampling one token from a row of logits, and the log-prob the trainer recomputes.

The behaviour log-prob (what `GenerationResult.logprobs` holds), for logits row `l` (fp32):
  z = l / temperature                      (elementwise; exactly `l` at temperature 1)
  S = the candidate set: token ids by descending softmax(z) (ties: lower id first), cut to
      `top_k` (if > 0), then to the shortest prefix whose mass reaches `top_p`, then to
      `candidate_cap`.
  The token is drawn from softmax(z) restricted to S, and its log-prob is
  `rlsys.model.token_log_probs(z, token, S)` = log_softmax(z with non-candidates at -inf).
So the recorded candidate set is *exactly* the support the token was sampled from
(`capped` says top-k/top-p admitted more than the cap and the tail was cut), and the
trainer's `token_log_probs(logits / temperature, targets, candidates)` over its
full-sequence forward reproduces the value bitwise at staleness 0: same logits (batch
invariance), same elementwise division, same function.

Determinism: a request's draws come from its own `torch.Generator`, one uniform per token,
so a seeded request yields the same tokens whatever it was batched with.

Batched: `sample_batch` samples every ready sequence of an engine step at once (rows are
independent: per-row sorts, scans and the row-invariant log-softmax) and copies tokens,
log-probs and candidate sets to the host once per step.

Device: everything that feeds the recorded log-prob (candidate set, restricted softmax,
`token_log_probs`) runs on the logits' device, which is the model's, because the trainer
recomputes the value on its model's device; only the draw (a CDF and one uniform) is on
the CPU.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from rlsys import kernels
from rlsys.engine.api import SamplingParams
from rlsys.model import candidate_mask, token_log_probs


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float
    candidates: list[int]
    capped: bool


def behaviour_log_probs(
    logits: Tensor, targets: Tensor, candidates: Tensor | None, temperature: float = 1.0
) -> Tensor:
    """The trainer-side recompute of the engine's log-probs (see module doc).

    logits (T, V) fp32 from the full forward, targets (T,), candidates (T, C) padded with -1.
    """
    return token_log_probs(logits / temperature, targets, candidates)


def request_seed(seed: int | None, engine_seed: int, request_id: str) -> int:
    """The request's own seed, or one derived from the engine seed and the request id."""
    if seed is not None:
        return seed
    digest = hashlib.sha256(f"{engine_seed}:{request_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


@dataclass(frozen=True)
class RowParams:
    """What one row's draw needs: its sampling parameters, candidate cap and generator."""

    params: SamplingParams
    cap: int
    rng: torch.Generator | None = None


def sample_batch(
    logits: Tensor, rows: list[RowParams], sample_vocab: int | None = None
) -> list[SampledToken]:
    """Draw one token per row of fp32 logits (B, V) (see module doc); one host copy."""
    b, v = logits.shape
    dev = logits.device
    temps = torch.tensor([r.params.temperature for r in rows], dtype=logits.dtype, device=dev)
    z = logits / temps[:, None]
    if sample_vocab is not None and sample_vocab < v:
        # Padding ids of the model's vocabulary are never sampled (no text behind them).
        z = z.clone()
        z[:, sample_vocab:] = float("-inf")
    cand, capped = candidate_sets(z, rows)  # (B, C) padded with -1
    mask = candidate_mask(cand, v)
    restricted = kernels.log_softmax(z.masked_fill(~mask, float("-inf")))
    probs = restricted.gather(-1, cand.clamp_min(0)).double().exp().masked_fill(cand < 0, 0.0)
    cdf = torch.cumsum(probs, -1)
    u = torch.tensor(
        [float(torch.rand((), generator=r.rng, dtype=torch.float64)) for r in rows],  # type: ignore[arg-type]
        dtype=torch.float64,
        device=dev,
    )
    count = (cand >= 0).sum(-1)
    pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).squeeze(-1)
    pick = torch.minimum(pick, count - 1)
    tokens = cand.gather(-1, pick[:, None]).squeeze(-1)
    logprob = token_log_probs(z, tokens, cand)
    host = torch.stack(
        [tokens.double(), logprob.double(), capped.double(), count.double()], -1
    ).cpu()
    cand_host = cand.cpu()
    out = []
    for i in range(b):
        token, lp, cut, n = host[i].tolist()
        assert math.isfinite(lp), "a sampled token always lies in its candidate set"
        out.append(SampledToken(int(token), float(lp), cand_host[i, : int(n)].tolist(), bool(cut)))
    return out


def candidate_sets(z: Tensor, rows: list[RowParams]) -> tuple[Tensor, Tensor]:
    """Per row of z (B, V): candidate ids by descending probability, cut by top-k, top-p
    and the row's cap, padded with -1 to the widest cap; and whether the cap cut the set."""
    dev = z.device
    logp = kernels.log_softmax(z)
    order = torch.sort(logp, dim=-1, descending=True, stable=True).indices
    n = torch.isfinite(z).sum(-1)  # ids masked to -inf are never candidates
    top_k = torch.tensor([r.params.top_k for r in rows], device=dev)
    n = torch.where(top_k > 0, torch.minimum(top_k, n), n)
    top_p = torch.tensor([r.params.top_p for r in rows], dtype=torch.float64, device=dev)
    width = min(max(r.cap for r in rows), z.shape[-1])
    # a nucleus is measured over the whole sorted row (it can be wider than any cap)
    head = z.shape[-1] if any(r.params.top_p < 1.0 for r in rows) else width
    probs = logp.gather(-1, order[:, :head]).double().exp()
    mass_before = torch.cumsum(probs, -1) - probs
    inside = torch.arange(head, device=dev)[None, :] < n[:, None]
    n_p = ((mass_before < top_p[:, None]) & inside).sum(-1).clamp_min(1)
    n = torch.where(top_p < 1.0, torch.minimum(n_p, n), n)
    cap = torch.tensor([r.cap for r in rows], device=dev)
    keep = torch.minimum(n, cap)
    ids = order[:, :width]
    cols = torch.arange(ids.shape[1], device=dev)[None, :]
    return torch.where(cols < keep[:, None], ids, -1), n > cap


def candidate_set(z: Tensor, top_k: int, top_p: float, cap: int) -> tuple[Tensor, bool]:
    """Candidate ids (C,) in descending probability of z (V,), and whether the cap cut it."""
    row = RowParams(SamplingParams(top_k=top_k, top_p=top_p), cap)
    ids, capped = candidate_sets(z[None], [row])
    return ids[0][ids[0] >= 0], bool(capped[0])


def sample(logits: Tensor, params: SamplingParams, cap: int, rng: torch.Generator) -> SampledToken:
    """Draw one token from a fp32 logits row (V,) under `params`: `sample_batch` of one row."""
    return sample_batch(logits[None], [RowParams(params, min(cap, params.candidate_cap), rng)])[0]
