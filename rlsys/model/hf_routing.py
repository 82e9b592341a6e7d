"""Routed-expert replay (R3) for Hugging Face MoE models, through a hook on each router.

A router hook rewrites the router's output for the rows of the span being run: rows with a
recorded route take the recorded expert ids; their gates are recomputed from the current
router's probabilities over those ids (`indices`: the router keeps its gradient) or taken
as recorded (`indices_and_gates`). Rows without a record keep the router's own choice.
MoE layer l of the record is the l-th router in module order (the model's layer order).

Routers are found by class through `ROUTER_HOOKS` (a registry; today Qwen3-MoE's
`Qwen3MoeTopKRouter`, whose forward returns `(logits, top-k gates, top-k ids)`). A model
with no known router and a replay to apply is an error, never a silent no-op.

Tensor legend: n rows of the span, E experts, k experts per token.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from rlsys.model.routing import RoutingReplay


@dataclass
class _Span:
    row: int = 0
    n: int = 0


def _qwen3_moe_output(
    router: nn.Module, out: tuple[Tensor, Tensor, Tensor], ids_nk: Tensor, gates_nk: Tensor | None,
    mask_n: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    logits_nE, scores_nk, router_ids_nk = out
    ids = torch.where(mask_n[:, None], ids_nk.to(router_ids_nk.device), router_ids_nk)
    if gates_nk is None:
        picked = torch.softmax(logits_nE, dim=-1, dtype=torch.float).gather(-1, ids)
        if router.norm_topk_prob:
            picked = picked / picked.sum(-1, keepdim=True)
        gates = picked.to(scores_nk.dtype)
    else:
        gates = gates_nk.to(scores_nk.dtype)
    return logits_nE, torch.where(mask_n[:, None], gates, scores_nk), ids


RouterOutput = Callable[..., tuple[Tensor, Tensor, Tensor]]
ROUTER_HOOKS: dict[str, RouterOutput] = {"Qwen3MoeTopKRouter": _qwen3_moe_output}


def routers(model: nn.Module) -> list[nn.Module]:
    """The model's MoE routers, in layer order."""
    return [m for m in model.modules() if type(m).__name__ in ROUTER_HOOKS]


@contextmanager
def replay_routes(model: nn.Module, replay: RoutingReplay | None) -> Iterator[_Span]:
    """While active, the routers replay `replay` for the rows of the yielded span (set its
    `row` and `n` before each span's forward). `replay=None`: nothing is hooked."""
    span = _Span()
    if replay is None:
        yield span
        return
    found = routers(model)
    layers = replay.routes.indices.shape[0]
    if len(found) != layers:
        raise ValueError(f"routes for {layers} MoE layers; the model has {len(found)} routers")
    handles = []
    for layer, router in enumerate(found):
        rewrite = ROUTER_HOOKS[type(router).__name__]

        def hook(module: nn.Module, args: object, out: tuple, layer: int = layer,
                 rewrite: RouterOutput = rewrite) -> tuple:  # fmt: skip
            ids, gates = replay.lookup(layer)
            rows = slice(span.row, span.row + span.n)
            mask = (
                replay.rows[rows]
                if replay.rows is not None
                else torch.ones(span.n, dtype=torch.bool)
            )
            picked = None if gates is None else gates[rows]
            return rewrite(module, out, ids[rows], picked, mask.to(out[0].device))

        handles.append(router.register_forward_hook(hook))
    try:
        yield span
    finally:
        for handle in handles:
            handle.remove()
