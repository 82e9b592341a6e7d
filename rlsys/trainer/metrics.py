"""What one trainer step reports (`monitor --json`: docs/ARCHITECTURE.md, "Command line").

Token-level quantities (entropy, importance weight, log-prob drift) are averaged over the
step's policy tokens, accumulated across micro-batches; staleness over the step's kept
samples; `reward_mean` over every sample the step consumed (filtered ones included: a
zero-variance group of failures is still the policy failing), `reward_mean_kept` over the
kept ones. `as_dict` gives the JSON shape the monitor prints.

`mismatch` is the train/inference mismatch: the engine's recorded log-prob against the
trainer's recomputation under the very weights that sampled the token — free for the
step's staleness-0 tokens, and for a sample of older rollouts recomputed from host copies
of their versions (`rlsys.trainer.snapshots`). It is exactly 0 when the two paths agree
bitwise, at any staleness; absent from a step where nothing was measured (None, never a
zero that was not measured). `logprob_drift` is behaviour against the current policy: the
mismatch plus the policy's own updates since.

`kl` is the KL to the reference policy where the job has one (`kl_source: reference`);
without one it is the k3 estimate of KL(behaviour || current) over the step's policy
tokens (`kl_source: behaviour`), which costs nothing extra and is 0 only where the policy
that sampled equals the one being trained.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor


@dataclass
class StepMetrics:
    step: int
    policy_version: int
    num_samples: int
    num_filtered: int
    num_tokens: int = 0
    num_policy_tokens: int = 0
    loss: float = 0.0
    pg_loss: float = 0.0
    kl: float = 0.0
    entropy: float = 0.0
    mean_importance_weight: float = 0.0
    clipped_fraction: float = 0.0
    logprob_drift_mean_abs: float = 0.0
    logprob_drift_max_abs: float = 0.0
    staleness_mean: float = 0.0
    staleness_max: int = 0
    reward_mean: float = 0.0
    reward_mean_kept: float = 0.0
    grad_norm: float = 0.0
    grad_clamp_clipped: int = 0
    kl_source: str = "behaviour"
    critic_loss: float = 0.0
    critic_baseline: bool = False
    step_s: float = 0.0
    tokens_per_s: float = 0.0
    mismatch: dict[str, float] | None = None
    # sizes of the recorded candidate (top-p) sets of the step's policy tokens
    candidate_set: dict[str, float] | None = None

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["staleness"] = {"mean": d.pop("staleness_mean"), "max": d.pop("staleness_max")}
        d["logprob_drift"] = {
            "mean_abs": d.pop("logprob_drift_mean_abs"),
            "max_abs": d.pop("logprob_drift_max_abs"),
        }
        for optional in ("mismatch", "candidate_set"):
            if d[optional] is None:
                del d[optional]
        return d


@dataclass
class TokenSums:
    """Per-token sums over the micro-batches of one step (weights: the aggregation's)."""

    tokens: int = 0
    loss: float = 0.0
    pg: float = 0.0
    kl: float = 0.0
    critic: float = 0.0
    entropy: float = 0.0
    weight: float = 0.0
    clipped: float = 0.0
    drift_abs: float = 0.0
    drift_max: float = 0.0
    mismatch_tokens: int = 0
    mismatch_abs: float = 0.0
    mismatch_max: float = 0.0
    mismatch_k3: float = 0.0
    behaviour_k3: float = 0.0
    has_reference: bool = False
    extra: dict[str, float] = field(default_factory=dict)
    _pending: list[Tensor] = field(default_factory=list, repr=False)  # device rows (`add`)

    @torch.no_grad()
    def add(
        self,
        logp_P: Tensor,
        behaviour_P: Tensor,
        entropy_P: Tensor,
        tis_cap: float,
        weighted: tuple[Tensor, Tensor, Tensor, Tensor],
        fresh_P: Tensor | None = None,
    ) -> None:
        """`weighted`: this micro-batch's aggregated (loss, pg, kl, critic) contributions;
        `fresh_P`: which tokens the trainer's current version sampled (staleness 0).

        Computed on the device and read back once, by `settle` (a host read per value
        here would wait for the GPU after every micro-batch)."""
        diff = logp_P.detach() - behaviour_P
        if fresh_P is None:
            fresh_P = torch.zeros_like(diff, dtype=torch.bool)
        w = torch.exp(diff)
        k3 = torch.exp(diff) - 1.0 - diff
        drift = diff.abs()
        zero = diff.new_zeros(())
        fresh_drift, fresh_k3 = torch.where(fresh_P, drift, zero), torch.where(fresh_P, k3, zero)
        sums = [entropy_P.sum(), w.sum(), (w > tis_cap).sum(), drift.sum(), k3.sum()]
        sums += list(weighted)
        sums += [fresh_P.sum(), fresh_drift.sum(), fresh_k3.sum()]
        empty = not diff.numel()
        maxima = [zero if empty else drift.max(), zero if empty else fresh_drift.max()]
        self.tokens += int(logp_P.numel())
        self._pending.append(torch.stack([v.float() for v in sums + maxima]))

    def settle(self, extra: Sequence[Tensor] = ()) -> list[float]:
        """Fold the micro-batches' device sums into the fields, and return the values of
        the `extra` device scalars (the step's grad norm, say): one host read for all."""
        if not self._pending and not extra:
            return []
        width = len(self._pending[0]) if self._pending else 0
        flat = [torch.stack(self._pending).flatten().double()] if self._pending else []
        if extra:
            flat.append(torch.stack([e.detach().double().reshape(()) for e in extra]))
        values = torch.cat(flat).cpu().tolist()
        rows = [values[i * width : (i + 1) * width] for i in range(len(self._pending))]
        self._pending.clear()
        for row in rows:
            entropy, weight, clipped, drift, k3, loss, pg, kl, critic = row[:9]
            fresh, fresh_abs, fresh_k3, drift_max, fresh_max = row[9:]
            self.entropy += entropy
            self.weight += weight
            self.clipped += clipped
            self.drift_abs += drift
            self.drift_max = max(self.drift_max, drift_max)
            self.behaviour_k3 += k3
            self.loss, self.pg, self.kl = self.loss + loss, self.pg + pg, self.kl + kl
            self.critic += critic
            if fresh:
                self.mismatch_tokens += int(fresh)
                self.mismatch_abs += fresh_abs
                self.mismatch_max = max(self.mismatch_max, fresh_max)
                self.mismatch_k3 += fresh_k3
        return values[len(values) - len(extra) :]

    @torch.no_grad()
    def add_mismatch(self, diff: Tensor) -> None:
        """Recomputed minus recorded log-probs of tokens, each under the weights that
        sampled it."""
        if not diff.numel():
            return
        self.mismatch_tokens += int(diff.numel())
        self.mismatch_abs += float(diff.abs().sum())
        self.mismatch_max = max(self.mismatch_max, float(diff.abs().max()))
        # k3 estimate of KL(behaviour || trainer) from the behaviour's own samples
        self.mismatch_k3 += float((torch.exp(diff) - 1.0 - diff).sum())

    def fill(self, m: StepMetrics, extra: Sequence[Tensor] = ()) -> list[float]:
        """Write the step's sums into `m`; returns the `extra` device scalars' values, read
        with the sums (`settle`)."""
        extra_values = self.settle(extra)
        n = max(self.tokens, 1)
        m.num_policy_tokens = self.tokens
        m.loss, m.pg_loss, m.kl, m.critic_loss = self.loss, self.pg, self.kl, self.critic
        m.kl_source = "reference" if self.has_reference else "behaviour"
        if not self.has_reference:
            m.kl = self.behaviour_k3 / n
        m.entropy = self.entropy / n
        m.mean_importance_weight = self.weight / n
        m.clipped_fraction = self.clipped / n
        m.logprob_drift_mean_abs = self.drift_abs / n
        m.logprob_drift_max_abs = self.drift_max
        if self.mismatch_tokens:
            m.mismatch = {
                "tokens": self.mismatch_tokens,
                "mean_abs": self.mismatch_abs / self.mismatch_tokens,
                "max_abs": self.mismatch_max,
                "k3_kl": self.mismatch_k3 / self.mismatch_tokens,
            }
        return extra_values


def candidate_set_sizes(batches: list[Any]) -> dict[str, float] | None:
    """Mean, median, p90 and max size of the recorded candidate sets (tokens that have one;
    None where none does): how much of the vocabulary the nucleus kept."""
    # no boolean indexing (it syncs to size its output): tokens without a set are NaN
    sizes = torch.cat([(b.candidates_PC >= 0).sum(1).float() for b in batches])
    has = torch.cat([b.has_candidates_P for b in batches])
    if not sizes.numel():
        return None
    masked = torch.where(has, sizes, float("nan"))
    quantiles = (masked.nanquantile(0.5), masked.nanquantile(0.9))  # float q: no upload
    largest = torch.where(has, sizes, float("-inf")).max()
    stats = torch.stack([has.sum().float(), masked.nanmean(), *quantiles, largest]).tolist()
    count, mean, p50, p90, top = stats  # one host read
    if not count:
        return None
    return {"mean": mean, "p50": p50, "p90": p90, "max": top}
