"""The trainer's forward: packed segments -> hidden states, with routed-expert replay.

Replay modes (a registry, `trainer.replay_experts`):
- `off`: every row is routed by the current router;
- `indices`: rows with a recorded route use the recorded expert ids, gates recomputed from
  the current router (so the router still gets a gradient);
- `indices_and_gates`: recorded ids and recorded gates (bitwise the engine's forward when
  the weights are the engine's).
Rows without a record (prompt, observations) are always routed by the current router.
The same mode is used for the actor and for the reference policy.

Selection replay (`trainer.replay_selections`, independent of the expert mode): rows with
recorded Sparse GQA selections attend to the engine's blocks instead of the current
indexer's top-k (the third discrete decision inference made: docs/ARCHITECTURE.md,
"Numerics", Replay).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from rlsys.model import AuxLosses, Transformer
from rlsys.model.attention import SeqSpan
from rlsys.model.routing import Routing, RoutingReplay
from rlsys.trainer.batch import PackedBatch


def _no_replay(batch: PackedBatch, selections: bool) -> Routing | None:
    if not selections or batch.routes is None:
        return None
    return RoutingReplay(
        batch.routes, use_gates=False, rows=batch.routed_rows_N, blocks=True, experts=False
    )


def _replay(use_gates: bool) -> Callable[[PackedBatch, bool], Routing | None]:
    def build(batch: PackedBatch, selections: bool) -> Routing | None:
        if batch.routes is None:
            return None
        return RoutingReplay(
            batch.routes, use_gates=use_gates, rows=batch.routed_rows_N, blocks=selections
        )

    return build


REPLAY_MODES: dict[str, Callable[[PackedBatch, bool], Routing | None]] = {
    "off": _no_replay,
    "indices": _replay(False),
    "indices_and_gates": _replay(True),
}


def packed_hidden(
    model: Transformer,
    batch: PackedBatch,
    replay: str,
    aux: AuxLosses | None = None,
    selections: bool = False,
) -> Tensor:
    """fp32 hidden states (N, d) of every packed row (each segment from position 0).

    `selections`: replay the recorded Sparse GQA selections (a batch packed without
    recorded selections cannot: that is an error, not a silent fallback)."""
    spans = [SeqSpan(row, n, 0) for row, n in batch.spans]
    if selections and batch.routes is not None and batch.routes.blocks is None:
        raise ValueError(
            "trainer.replay_selections needs the engine's selections: set engine.record_selections"
        )
    routing = REPLAY_MODES[replay](batch, selections)
    return model.hidden_packed(batch.tokens_N, spans, routing, aux)


def packed_hidden_no_grad(
    model: Transformer, batch: PackedBatch, replay: str, selections: bool = False
) -> Tensor:
    with torch.no_grad():
        return packed_hidden(model, batch, replay, selections=selections)
