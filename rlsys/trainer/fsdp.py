"""FSDP2 for the native policy: shard a `Transformer` over a device mesh, gather it back.

`shard_policy` applies `torch.distributed.fsdp.fully_shard` to each transformer block,
then to the root (embedding, final norm, LM head, MTP heads), and registers the entry
points the trainer calls instead of `forward` (`hidden_packed`), so FSDP all-gathers a
unit's parameters before it runs and reduce-scatters its gradients after the backward.

Invariants:
- Gradients are reduce-scattered as a SUM, not a mean (divide factor 1): each rank's loss
  is its share of the one global loss (`DataParallel`), so the sum over ranks is exactly
  the single-rank gradient.
- Every function here that touches parameters is a collective: every rank of the mesh must
  call it, in the same order, with the same arguments (else the ranks hang until the
  process group's timeout, which then raises).
- `full_state_dict` returns full tensors under the keys, shapes and dtypes of the
  unsharded model's `state_dict()`, on every rank (buffers are never sharded: each rank
  holds the same copy), so engines and checkpoints never see a shard.
- `load_full_state_dict` is the inverse: full tensors in, each rank keeps its shard.
- Buffers (MoE load and selection bias, gradient-clamp counters) stay per rank; the
  trainer all-reduces the load before the balance update so the bias stays identical.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor

from rlsys.model import Transformer
from rlsys.model.moe import MoE

# the trainer's forwards: the packed trunk (the LM head runs on the root's gathered
# parameters, which FSDP keeps unsharded from the root's forward to the end of backward)
_ENTRY_POINTS = ("hidden_packed",)


def shard_policy(model: Transformer, mesh: DeviceMesh) -> Transformer:
    """Shard `model` in place (each block a unit, the rest the root unit); returns it."""
    if not isinstance(model, Transformer):
        raise ValueError(
            f"trainer.data_parallel > 1 shards the native Transformer only, not "
            f"{type(model).__name__} (model.kind: native)"
        )
    for block in model.blocks:
        if isinstance(block.ffn, MoE):  # a forward's gathered experts, not a kept copy
            block.ffn.stack_cache = False
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for name in _ENTRY_POINTS:
        register_fsdp_forward_method(model, name)
    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            # a plain SUM (gloo has no pre-multiplied sum): the ranks' losses add up to one
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)
            # a rank whose micro-batches leave a parameter without gradient still takes
            # part in that reduce-scatter (with zeros), so the collectives stay matched
            if hasattr(unit, "set_reduce_scatter_unused_params"):
                unit.set_reduce_scatter_unused_params(True, recurse=False)
            elif mesh.size() > 1:  # (torch 2.11 has no such switch; one rank needs none)
                raise RuntimeError(
                    "trainer.data_parallel > 1 needs a torch whose FSDP2 can reduce-scatter "
                    "unused parameters (FSDPModule.set_reduce_scatter_unused_params; the "
                    f"project's torch 2.13 has it, this is {torch.__version__})"
                )
    return model


def full_state_dict(
    model: torch.nn.Module, device: str | torch.device = "cpu"
) -> dict[str, Tensor]:
    """The unsharded model's `state_dict()` (same keys, shapes, dtypes) on `device`, on
    every rank. A collective: each DTensor is all-gathered in the state dict's order."""
    out: dict[str, Tensor] = {}
    for key, value in model.state_dict().items():
        full = value.full_tensor() if isinstance(value, DTensor) else value
        out[key] = full.detach().to(device, copy=True)
    return out


def load_full_state_dict(model: torch.nn.Module, state: dict[str, Tensor]) -> None:
    """Load full tensors (every rank passes the same) into the sharded model: each rank
    keeps its shard; buffers are copied whole."""
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))


def full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Any:
    """The optimiser's state with full (gathered) tensors, keyed by parameter name, on
    every rank's CPU. A collective."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, broadcast_from_rank0=False)
    state = get_optimizer_state_dict(model, optimizer, options=options)
    return _gather_dtensors(state)


def load_full_optimizer_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: Any
) -> None:
    """Inverse of `full_optimizer_state` (every rank passes the same state). A collective."""
    set_optimizer_state_dict(
        model, optimizer, state, options=StateDictOptions(full_state_dict=True)
    )


def _gather_dtensors(value: Any) -> Any:
    if isinstance(value, DTensor):
        return value.full_tensor().cpu()
    if isinstance(value, dict):
        return {k: _gather_dtensors(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_gather_dtensors(v) for v in value]
    return value


def clip_grad_norm(parameters: list[torch.nn.Parameter], max_norm: float) -> Tensor:
    """Clip to the global gradient norm of `parameters` (sharded or not); returns it.

    A sharded gradient's norm is a partial sum over ranks: it is reduced (`full_tensor`)
    before the clip, so every rank scales its shard by the same global coefficient."""
    grads = [p.grad for p in parameters if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, 2.0)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total)
    return total
