"""Host copies of the policy's recent versions, for measuring train/inference mismatch.

`mismatch` compares the engine's recorded log-prob of a token with the trainer's
recomputation *under the weights that sampled it*; the difference is then the two paths'
disagreement alone, without the policy's own updates since (that is `logprob_drift`). At
staleness 0 those weights are the trainer's current ones; for older tokens they are kept
here, one host copy per version, for the versions a sample may still carry (the staleness
bound), and recomputed in a scratch model on the trainer's device.

Invariants: the snapshot of version v is taken while the trainer's weights are version
v's (before the step that makes v + 1, or right after the step that made v); versions
older than `current - keep` are dropped, so the host holds at most `keep + 1` copies.
A version taken after a resume from an older checkpoint is simply absent: its tokens are
not measured, never compared with other weights.

Data parallel: `take` is then a collective (`gather` all-gathers the full weights on every
rank, each deciding alike whether to), and only the rank that measures (`store`) keeps the
copy; the others keep the version's name alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from rlsys.model import Transformer
from rlsys.trajectory import Trajectory


class VersionSnapshots:
    def __init__(self, keep: int, store: bool = True) -> None:
        self.keep, self.store = keep, store
        self.states: dict[int, dict[str, Tensor]] = {}

    def take(
        self,
        version: int,
        model: Transformer,
        gather: Callable[[], dict[str, Tensor]] | None = None,
    ) -> None:
        """Record `model`'s weights as `version` (idempotent) and drop the expired ones.

        `gather`: how to get the full weights on the host (default: the state dict)."""
        if version not in self.states:
            state = (
                gather()
                if gather is not None
                else {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
            )
            self.states[version] = state if self.store else {}
        for old in [v for v in self.states if v < version - self.keep]:
            del self.states[old]

    def __contains__(self, version: int) -> bool:
        return version in self.states

    def load_into(self, model: Transformer, version: int) -> None:
        model.load_state_dict(self.states[version])


def policy_columns(traj: Trajectory) -> tuple[Tensor, Tensor]:
    """(versions, behaviour log-probs) of a trajectory's policy tokens, in the segment
    order `Trainer.log_probs` returns them."""
    versions: list[int] = []
    behaviour: list[float] = []
    for seg in traj.segments:
        for i, on in enumerate(seg.policy_mask):
            if on:
                versions.append(seg.versions[i])
                behaviour.append(seg.logprobs[i])
    return torch.tensor(versions, dtype=torch.int64), torch.tensor(behaviour)


def stale_sample(kept: Sequence[Trajectory], version: int, count: int) -> list[Trajectory]:
    """Up to `count` trajectories holding a token older than `version`: the most stale
    first, then in arrival order (deterministic)."""
    stale = [t for t in kept if t.min_version < version]
    return sorted(stale, key=lambda t: t.min_version)[:count]
