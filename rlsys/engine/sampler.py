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
so a seeded request yields the same tokens whatever it was batched with. A long-lived row
(an engine sequence's) draws them `UniformStream.BLOCK` at a time: a CPU generator fills
a tensor serially, so the n-th value is the n-th one-element draw's (tested); the stream
owns its generator, which nothing else draws from.

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
from typing import NamedTuple

import torch
from torch import Tensor

from rlsys import kernels
from rlsys.config.sampling import SamplingConfig
from rlsys.model import candidate_mask, token_log_probs


class SampledToken(NamedTuple):
    """One drawn token as the host reads it (a named tuple: the engine makes one per
    sequence per decode step, and a tuple is the cheapest immutable record to build)."""

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


class UniformStream:
    """One row's uniforms from its own generator, drawn `BLOCK` at a time (one host op per
    block, not one per token; see module doc). The stream owns the generator: a draw made
    from the generator beside it would change the values that follow."""

    BLOCK = 64

    def __init__(self, rng: torch.Generator) -> None:
        self._rng = rng
        self._block: list[float] = []
        self._next = 0

    def next(self) -> float:
        if self._next == len(self._block):
            block = torch.empty(self.BLOCK, dtype=torch.float64)
            self._block, self._next = block.uniform_(generator=self._rng).tolist(), 0
        u = self._block[self._next]
        self._next += 1
        return u


@dataclass(frozen=True)
class RowParams:
    """What one row's draw needs: its sampling parameters, candidate cap and uniforms: from
    `stream` (a long-lived row), else one draw from `rng` per token (None: the global
    generator)."""

    params: SamplingConfig
    cap: int
    rng: torch.Generator | None = None
    stream: UniformStream | None = None

    def next_uniform(self) -> float:
        if self.stream is not None:
            return self.stream.next()
        return torch.empty(1, dtype=torch.float64).uniform_(generator=self.rng).item()


@dataclass(frozen=True)
class RowTensors:
    """The per-row sampling parameters of a batch as tensors on the logits' device."""

    temps: Tensor  # (B,) fp32
    top_k: Tensor  # (B,) int64, 0: off
    top_p: Tensor  # (B,) fp64
    caps: Tensor  # (B,) int64
    u: Tensor  # (B,) fp64: each row's uniform draw


@dataclass(frozen=True)
class SampleOut:
    """A batch's draws, on the device (no host sync until they are read)."""

    tokens: Tensor  # (B,) int64
    logprob: Tensor  # (B,) fp32
    capped: Tensor  # (B,) bool
    count: Tensor  # (B,) int64: candidates per row
    cand: Tensor  # (B, C) int64, -1 padded

    def packed(self, n: int) -> Tensor:
        """The first n rows as one (n, 4 + C) fp64 device tensor (token, log-prob, capped,
        count, candidates): what one copy brings to the host for `unpack`."""
        head = torch.stack(
            [self.tokens, self.logprob.double(), self.capped.double(), self.count], -1
        )
        return torch.cat([head.double()[:n], self.cand[:n].double()], dim=1)

    @staticmethod
    def unpack(host: Tensor) -> list[SampledToken]:
        """`packed`'s rows back as tokens. The candidate ids (exact in fp64) become int64 in
        one host op, so each row's list is a slice of a ready list of ints: no per-id
        conversion in Python (this runs for every sequence at every decode step)."""
        heads = host[:, :4].tolist()
        # only the columns some row's set reaches: the cap is wide, a trained policy's
        # nucleus is usually a handful of tokens
        width = int(max((h[3] for h in heads), default=0))
        cands = host[:, 4 : 4 + width].to(torch.int64).tolist()
        out = []
        for (token, lp, cut, count), ids in zip(heads, cands, strict=True):
            assert math.isfinite(lp), "a sampled token always lies in its candidate set"
            out.append(SampledToken(int(token), lp, ids[: int(count)], cut != 0.0))
        return out

    def to_host(self, n: int) -> list[SampledToken]:
        """The first n rows as `SampledToken`s: one device -> host copy."""
        return self.unpack(self.packed(n).cpu())


def draw_uniforms(rows: list[RowParams]) -> list[float]:
    """One uniform per row from the row's own generator (one per sampled token): the one
    place a draw is made, so eager and graph steps draw alike."""
    return [r.next_uniform() for r in rows]


def row_tensors(rows: list[RowParams], u: list[float], device: torch.device) -> RowTensors:
    return RowTensors(
        torch.tensor([r.params.temperature for r in rows], dtype=torch.float32, device=device),
        torch.tensor([r.params.top_k for r in rows], device=device),
        torch.tensor([r.params.top_p for r in rows], dtype=torch.float64, device=device),
        torch.tensor([r.cap for r in rows], device=device),
        torch.tensor(u, dtype=torch.float64, device=device),
    )


def sample_batch(
    logits: Tensor, rows: list[RowParams], sample_vocab: int | None = None
) -> list[SampledToken]:
    """Draw one token per row of fp32 logits (B, V) (see module doc); one host copy."""
    v = logits.shape[1]
    params = row_tensors(rows, draw_uniforms(rows), logits.device)
    width = min(max(r.cap for r in rows), v)
    # a nucleus is measured over the whole sorted row (it can be wider than any cap)
    head = v if any(r.params.top_p < 1.0 for r in rows) else width
    return sample_rows(logits, params, width, head, sample_vocab).to_host(len(rows))


def sample_rows(
    logits: Tensor, p: RowTensors, width: int, head: int, sample_vocab: int | None
) -> SampleOut:
    """The device work of `sample_batch`, without a host sync (a CUDA graph can hold it).

    `width`: candidate columns (>= every row's cap); `head`: sorted columns a nucleus is
    measured over (the whole row when a row has top_p < 1; any larger value gives the
    same result)."""
    v = logits.shape[1]
    z = logits / p.temps[:, None]
    if sample_vocab is not None and sample_vocab < v:
        # Padding ids of the model's vocabulary are never sampled (no text behind them).
        z = z.clone()
        z[:, sample_vocab:] = float("-inf")
    cand, capped = _candidates(z, p, width, head)  # (B, C) padded with -1
    mask = candidate_mask(cand, v)
    restricted = kernels.log_softmax(z.masked_fill(~mask, float("-inf")))
    probs = restricted.gather(-1, cand.clamp_min(0)).double().exp().masked_fill(cand < 0, 0.0)
    cdf = torch.cumsum(probs, -1)
    count = (cand >= 0).sum(-1)
    pick = torch.searchsorted(cdf, (p.u * cdf[:, -1])[:, None]).squeeze(-1)
    pick = torch.minimum(pick, count - 1)
    tokens = cand.gather(-1, pick[:, None]).squeeze(-1)
    logprob = token_log_probs(z, tokens, cand)
    return SampleOut(tokens, logprob, capped, count, cand)


def candidate_sets(z: Tensor, rows: list[RowParams]) -> tuple[Tensor, Tensor]:
    """Per row of z (B, V): candidate ids by descending probability, cut by top-k, top-p
    and the row's cap, padded with -1 to the widest cap; and whether the cap cut the set."""
    v = z.shape[-1]
    width = min(max(r.cap for r in rows), v)
    head = v if any(r.params.top_p < 1.0 for r in rows) else width
    return _candidates(z, row_tensors(rows, [0.0] * len(rows), z.device), width, head)


def _candidates(z: Tensor, p: RowTensors, width: int, head: int) -> tuple[Tensor, Tensor]:
    dev = z.device
    logp = kernels.log_softmax(z)
    order = torch.sort(logp, dim=-1, descending=True, stable=True).indices
    n = torch.isfinite(z).sum(-1)  # ids masked to -inf are never candidates
    n = torch.where(p.top_k > 0, torch.minimum(p.top_k, n), n)
    probs = logp.gather(-1, order[:, :head]).double().exp()
    mass_before = torch.cumsum(probs, -1) - probs
    inside = torch.arange(head, device=dev)[None, :] < n[:, None]
    n_p = ((mass_before < p.top_p[:, None]) & inside).sum(-1).clamp_min(1)
    n = torch.where(p.top_p < 1.0, torch.minimum(n_p, n), n)
    keep = torch.minimum(n, p.caps)
    ids = order[:, :width]
    cols = torch.arange(ids.shape[1], device=dev)[None, :]
    return torch.where(cols < keep[:, None], ids, -1), n > p.caps


def candidate_set(z: Tensor, top_k: int, top_p: float, cap: int) -> tuple[Tensor, bool]:
    """Candidate ids (C,) in descending probability of z (V,), and whether the cap cut it."""
    row = RowParams(SamplingConfig(top_k=top_k, top_p=top_p), cap)
    ids, capped = candidate_sets(z[None], [row])
    return ids[0][ids[0] >= 0], bool(capped[0])


def sample(logits: Tensor, params: SamplingConfig, cap: int, rng: torch.Generator) -> SampledToken:
    """Draw one token from a fp32 logits row (V,) under `params` with candidate cap `cap`
    (the engine's): `sample_batch` of one row."""
    return sample_batch(logits[None], [RowParams(params, cap, rng)])[0]
