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


def candidate_set(z: Tensor, top_k: int, top_p: float, cap: int) -> tuple[Tensor, bool]:
    """Candidate ids (C,) in descending probability of z (V,), and whether the cap cut it."""
    logp = kernels.log_softmax(z[None])[0]
    order = torch.sort(logp, descending=True, stable=True).indices
    n = int(torch.isfinite(z).sum())  # ids masked to -inf are never candidates
    n = n if top_k <= 0 else min(top_k, n)
    if top_p < 1.0:
        probs = logp[order[:n]].double().exp()
        mass_before = torch.cumsum(probs, 0) - probs
        n = max(1, int((mass_before < top_p).sum()))
    return order[: min(n, cap)], n > cap


def sample(logits: Tensor, params: SamplingParams, cap: int, rng: torch.Generator) -> SampledToken:
    """Draw one token from a fp32 logits row (V,) under `params` (see module doc)."""
    z = logits / params.temperature
    cand, capped = candidate_set(z, params.top_k, params.top_p, min(cap, params.candidate_cap))
    padded = cand[None]
    mask = candidate_mask(padded, z.shape[-1])
    restricted = kernels.log_softmax(z[None].masked_fill(~mask, float("-inf")))[0]
    cdf = torch.cumsum(restricted[cand].double().exp(), 0).cpu()
    u = float(torch.rand((), generator=rng, dtype=torch.float64)) * float(cdf[-1])
    pick = min(int(torch.searchsorted(cdf, torch.tensor([u], dtype=torch.float64))), len(cand) - 1)
    token = int(cand[pick])
    target = torch.tensor([token], device=z.device)
    logprob = float(token_log_probs(z[None], target, padded)[0])
    assert math.isfinite(logprob), "a sampled token always lies in its candidate set"
    return SampledToken(token, logprob, cand.tolist(), capped)
