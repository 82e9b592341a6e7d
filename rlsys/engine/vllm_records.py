"""A sampled token's record from vLLM's returned log-probs (no vLLM import: unit-testable).

vLLM runs with `logprobs_mode="processed_logprobs"`: the log-probs it returns are computed
after temperature and top-k/top-p, so every id outside the nucleus is -inf and the finite
ones are the nucleus distribution, renormalised. For each generated token it returns the
`n` most probable ids plus the sampled one. From those:

- the behaviour log-prob is the sampled id's value: log_softmax over the nucleus of
  logits / temperature, exactly what the trainer's candidate-set replay recomputes
  (`rlsys.trainer.logprobs.masked_log_softmax`) up to the two implementations' rounding;
- the candidate set is the finite ids. It is *exact* when the nucleus fits in the returned
  entries: their probabilities then sum to 1. When they do not (the nucleus is larger than
  `n`), the record is flagged `capped` and carries no candidate set, so the trainer falls
  back to the whole sampleable vocabulary for that token (an approximation; the monitor's
  mismatch shows its cost). The native engine never needs this flag for correctness: it
  samples from the cut set itself.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

# Tolerance on the nucleus' total probability (fp32 log-probs summed in fp64).
MASS_TOL = 1e-4


@dataclass(frozen=True)
class TokenRecord:
    token_id: int
    logprob: float
    candidates: list[int]  # ids by descending probability; [] when capped
    capped: bool


def token_record(token_id: int, logprobs: Mapping[int, float]) -> TokenRecord:
    """The record of `token_id` from vLLM's {id: processed log-prob} of one position."""
    finite = sorted(
        ((lp, i) for i, lp in logprobs.items() if math.isfinite(lp)), key=lambda x: (-x[0], x[1])
    )
    mass = math.fsum(math.exp(lp) for lp, _ in finite)
    exact = mass >= 1.0 - MASS_TOL
    return TokenRecord(
        token_id=token_id,
        logprob=float(logprobs[token_id]),
        candidates=[i for _, i in finite] if exact else [],
        capped=not exact,
    )
