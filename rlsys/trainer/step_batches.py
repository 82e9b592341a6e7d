"""A step's micro-batches, packed when the passes reach them instead of all before the first.

`Trainer._plan` used to pack every micro-batch before the first kernel was queued, so the
GPU idled for all of it: for two 8K-token sequences of `large`, 38 ms of a 640 ms graphed
step on the H200, and 242 ms of 940 before packing kept the engine's route blocks whole
(`benchmarks/profile_trainer_phases.py`). The step's normalisers do not need the packed
batches: only each micro-batch's row count and the sample of each policy token
(`policy_samples`), which come from the trajectories directly. So the plan packs the first
micro-batch alone, and the passes pack micro-batch i + 1 after queueing micro-batch i's
forward and before its backward (`prefetch`). A backward waits for the device whenever the
device is behind, so the packing runs while the GPU works through the forward. On a
host-bound step (the eager trunk) the work is the same as before, just in another order.

Invariants:
- `on_device(i)` is `pack(groups[i], version=version).to(device)`, prefetched or not, and
  each micro-batch is packed once.
- `host()` returns every micro-batch packed, every rank's, for the step's metrics; the
  ones no pass has reached are packed then.
- The one assertion packing makes about its input (a segment never starts with a policy
  token) is checked for the whole step by `check`, before any pass, so it fails before any
  gradient or load statistic moves. A later packing failure would be a malformed route
  record: the step raises at that micro-batch, before the optimiser update.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from rlsys.trainer.batch import PackedBatch, pack
from rlsys.trajectory import Segment, Trajectory

Group = list[tuple[int, Segment, Trajectory]]  # one micro-batch's (sample, segment, trajectory)


def policy_samples(items: Sequence[tuple[int, Segment, Trajectory]]) -> Tensor:
    """(P,) int64: the step-list index of each policy token's trajectory, in `pack`'s order
    (its `sample_P`), without packing."""
    counts = [sum(seg.policy_mask) for _, seg, _ in items]
    samples = np.repeat(np.asarray([s for s, _, _ in items], dtype=np.int64), counts)
    return torch.from_numpy(samples)


def group_rows(items: Sequence[tuple[int, Segment, Trajectory]]) -> int:
    """Packed rows of a micro-batch (its `num_tokens`), without packing."""
    return sum(len(seg.token_ids) for _, seg, _ in items)


def check(groups: Sequence[Group]) -> None:
    """What `pack` asserts, for every segment of the step, before any pass runs."""
    for items in groups:
        for _, seg, traj in items:
            if seg.policy_mask and seg.policy_mask[0]:
                raise ValueError(
                    f"rollout {traj.rollout_id}: a segment starts with a policy token; a "
                    "segment starts with its prompt"
                )


class StepBatches:
    """The step's micro-batches: packed on first use, moved to the device once."""

    def __init__(self, groups: list[Group], version: int, device: torch.device) -> None:
        self.groups, self.version, self.target = groups, version, device
        self._host: list[PackedBatch | None] = [None] * len(groups)
        self._moved: dict[int, PackedBatch] = {}

    def __len__(self) -> int:
        return len(self.groups)

    def prefetch(self, i: int) -> None:
        """Pack micro-batch i and queue its copy to the device (no wait)."""
        if i not in self._moved:
            self._moved[i] = self._packed(i).to(self.target)

    def on_device(self, i: int) -> PackedBatch:
        """Micro-batch i on the device; the step's reference to the moved copy is dropped
        (a pass holds it while it runs)."""
        self.prefetch(i)
        return self._moved.pop(i)

    def host(self) -> list[PackedBatch]:
        """Every micro-batch packed (on the host)."""
        return [self._packed(i) for i in range(len(self.groups))]

    def _packed(self, i: int) -> PackedBatch:
        batch = self._host[i]
        if batch is None:
            batch = self._host[i] = pack(self.groups[i], version=self.version)
        return batch
