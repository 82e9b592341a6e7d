"""Where the trainer's policy lives: one process (`Local`) or sharded over a data-parallel
group with FSDP2 (`Sharded`), behind one interface the `Trainer` calls without asking which.

Everything that differs between the two is here: which micro-batches this rank runs and its
padding passes, how the loss is back-propagated, what is summed over ranks after the
passes, how the gradient norm is clipped (inside the fused update on one rank, in place
when sharded), how a full state dict is read and written, and the unsharded models the
trainer builds (reference policy, mismatch scratch model).

Invariants (`data_parallel.py`, `fsdp.py` hold the mechanics): under `Sharded` every method
that touches the policy is a collective (every rank calls it, in the same order, with the
same arguments); after `reduce_step` every rank holds the global token sums and expert load;
`full_state` returns full tensors keyed like the unsharded `state_dict()` on every rank.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from rlsys.model import Transformer
from rlsys.model.policy import PolicyModel
from rlsys.trainer.checkpoint import save_checkpoint
from rlsys.trainer.data_parallel import (
    DataParallel,
    assign_micro_batches,
    reduce_count,
    reduce_expert_load,
    reduce_gradients,
    reduce_token_sums,
)
from rlsys.trainer.fsdp import (
    full_optimizer_state,
    full_state_dict,
    load_full_optimizer_state,
    load_full_state_dict,
    shard_policy,
)
from rlsys.trainer.grad_clip import folded_clip
from rlsys.trainer.metrics import TokenSums
from rlsys.trainer.mtp_loss import clip_policy_and_mtp


class Local:
    """The whole policy in this process: the plain PyTorch path."""

    data_parallel: DataParallel | None = None
    measures = True  # this rank recomputes stale rollouts for the mismatch metric

    def prepare(self, model: PolicyModel) -> PolicyModel:
        return model

    def share(self, sizes: list[int]) -> tuple[list[int], int]:
        """This rank's micro-batches (indices into the step's list) and its padding passes."""
        return list(range(len(sizes))), 0

    def backward(self, loss: Tensor, heads: Tensor | None) -> None:
        loss.backward()
        if heads is not None:  # its own graph (detached inputs): trains the MTP heads only
            heads.backward()

    def reduce_step(self, sums: TokenSums, model: nn.Module) -> None:
        """Make the step's token sums and MoE load global (nothing to do on one rank)."""

    def reduce_count(self, count: int) -> int:
        return count

    def reduce_critic(self, critic: nn.Module) -> None:
        """Sum a replicated module's gradients over ranks (nothing on one rank)."""

    def clip(self, model: PolicyModel, max_norm: float) -> tuple[Tensor, Tensor | None]:
        """(the policy's gradient norm, the divisor the fused update applies to every
        gradient): the clip folded into the update (`grad_clip.py`)."""
        return folded_clip(model, max_norm)

    def full_state(self, model: nn.Module) -> dict[str, Tensor]:
        return model.state_dict()

    def load_state(self, model: nn.Module, state: dict[str, Tensor]) -> None:
        model.load_state_dict(state)

    def optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Any:
        return optimizer.state_dict()

    def load_optimizer_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: Any
    ) -> None:
        optimizer.load_state_dict(state)

    def frozen_copy(self, model: PolicyModel) -> PolicyModel:
        """A frozen copy of the current weights (the reference policy)."""
        ref = copy.deepcopy(model).eval()
        for p in ref.parameters():
            p.requires_grad_(False)
        return ref

    def scratch_model(self, model: PolicyModel) -> PolicyModel:
        """A model of the policy's shape to load old versions into (no collective)."""
        return copy.deepcopy(model)

    def snapshot_source(self, model: PolicyModel) -> Any:
        """What `VersionSnapshots.take` reads the weights through (None: the model)."""
        return None

    def save(self, path: str | Path, state: dict[str, Any]) -> Path:
        return save_checkpoint(path, state)


class Sharded(Local):
    """The policy sharded with FSDP2 over `data_parallel`'s mesh (every rank runs the same
    step on its share of the micro-batches; see `data_parallel.py`)."""

    def __init__(self, data_parallel: DataParallel) -> None:
        self.data_parallel = data_parallel
        self.measures = data_parallel.rank == 0  # the others gather with it

    @property
    def _dp(self) -> DataParallel:
        assert self.data_parallel is not None
        return self.data_parallel

    def prepare(self, model: PolicyModel) -> PolicyModel:
        return shard_policy(model, self._dp.mesh)  # type: ignore[arg-type]

    def share(self, sizes: list[int]) -> tuple[list[int], int]:
        """FSDP's collectives need as many passes on every rank: the short ranks pad."""
        shares = assign_micro_batches(sizes, self._dp.world_size)
        mine = shares[self._dp.rank]
        return mine, max(len(s) for s in shares) - len(mine)

    def backward(self, loss: Tensor, heads: Tensor | None) -> None:
        # one backward: FSDP reshards the root (LM head, embedding) when it ends
        (loss if heads is None else loss + heads).backward()

    def reduce_step(self, sums: TokenSums, model: nn.Module) -> None:
        reduce_token_sums(sums, self._dp.group)
        reduce_expert_load(model, self._dp.group)

    def reduce_count(self, count: int) -> int:
        return reduce_count(count, self._dp.group)

    def reduce_critic(self, critic: nn.Module) -> None:
        reduce_gradients(critic, self._dp.group)

    def clip(self, model: PolicyModel, max_norm: float) -> tuple[Tensor, Tensor | None]:
        """(the policy's gradient norm, None): clipped in place, the norm reduced over ranks
        first (the update divides by nothing)."""
        return clip_policy_and_mtp(model, max_norm, sharded=True), None  # type: ignore[arg-type]

    def full_state(self, model: nn.Module) -> dict[str, Tensor]:
        return full_state_dict(model)

    def load_state(self, model: nn.Module, state: dict[str, Tensor]) -> None:
        load_full_state_dict(model, state)

    def optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Any:
        return full_optimizer_state(model, optimizer)

    def load_optimizer_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: Any
    ) -> None:
        load_full_optimizer_state(model, optimizer, state)

    def frozen_copy(self, model: PolicyModel) -> PolicyModel:
        """Gathered once into a plain model, then sharded as the policy is."""
        ref = self.scratch_model(model)
        ref.load_state_dict(full_state_dict(model))
        for p in ref.parameters():
            p.requires_grad_(False)
        return shard_policy(ref, self._dp.mesh).eval()  # type: ignore[arg-type]

    def scratch_model(self, model: PolicyModel) -> PolicyModel:
        """An unsharded model of the policy's shape; its initial values are overwritten,
        so it must not draw from the global RNG."""
        with torch.random.fork_rng(devices=[]):
            device = next(model.parameters()).device
            return Transformer(model.cfg).to(device)  # type: ignore[attr-defined]

    def snapshot_source(self, model: PolicyModel) -> Any:
        return lambda: full_state_dict(model)

    def save(self, path: str | Path, state: dict[str, Any]) -> Path:
        """Rank 0 writes; no rank returns before the file is in place."""
        if self._dp.rank == 0:
            save_checkpoint(path, state)
        torch.distributed.barrier(group=self._dp.group)
        return Path(path)


def strategy_for(data_parallel: DataParallel | None) -> Local:
    """`Sharded` over the group when there is one, else `Local`."""
    return Local() if data_parallel is None else Sharded(data_parallel)
