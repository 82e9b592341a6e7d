"""Train/inference mismatch of stale rollouts: recompute a sample of the step's rollouts
older than the step's version under the weights that sampled each of their tokens.

The step's staleness-0 tokens are measured for free in the step itself (`TokenSums.add`);
older tokens need the weights of their version, kept as host copies (`snapshots.py`) and
loaded into a scratch model. Invariant: a version whose copy is absent (expired, or from
before a resume) is not measured, never compared with other weights.

Data parallel: snapshots are collectives (every rank gathers); only the rank the strategy
names (`measures`) keeps the copies and recomputes, and its metrics carry the result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import Tensor

from rlsys.model.policy import PolicyModel
from rlsys.trainer.metrics import TokenSums
from rlsys.trainer.snapshots import VersionSnapshots, policy_columns, stale_sample
from rlsys.trainer.strategy import Local
from rlsys.trajectory import Trajectory

# (trajectories, model, version) -> recomputed log-probs of each one's policy tokens
Recompute = Callable[[Sequence[Trajectory], PolicyModel, int], list[Tensor]]


class StaleMismatch:
    """Snapshots of recent versions and the recomputation of `rollouts` stale samples per
    step (0: off; nothing is kept)."""

    def __init__(self, rollouts: int, keep: int, strategy: Local) -> None:
        self.rollouts, self.strategy = rollouts, strategy
        self.snapshots = VersionSnapshots(keep=keep, store=strategy.measures)
        self._scratch: PolicyModel | None = None

    def snapshot(self, version: int, model: PolicyModel) -> None:
        """Keep `model`'s weights as `version` (a collective under data parallel)."""
        if self.rollouts:
            source = self.strategy.snapshot_source(model)
            self.snapshots.take(version, model, source)  # type: ignore[arg-type]

    def measure(
        self,
        kept: Sequence[Trajectory],
        version: int,
        model: PolicyModel,
        recompute: Recompute,
        sums: TokenSums,
    ) -> None:
        """Add the mismatch of a sample of `kept`'s tokens older than `version` to `sums`."""
        if not (self.rollouts and self.strategy.measures):
            return
        sample = stale_sample(kept, version, self.rollouts)
        if not sample:
            return
        if self._scratch is None:
            self._scratch = self.strategy.scratch_model(model)
        columns = [policy_columns(t) for t in sample]
        versions = sorted({v for vs, _ in columns for v in vs.tolist()} - {version})
        for v in (v for v in versions if v in self.snapshots):
            self.snapshots.load_into(self._scratch, v)  # type: ignore[arg-type]
            recomputed = recompute(sample, self._scratch, v)
            for logp, (vs, behaviour) in zip(recomputed, columns, strict=True):
                at_v = vs == v
                sums.add_mismatch(logp[at_v].float() - behaviour[at_v])
