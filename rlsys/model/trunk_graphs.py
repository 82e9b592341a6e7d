"""The trainer's block trunk as CUDA graphs: one forward and one backward replay per
micro-batch instead of ~300 launches per block, each with its host cost.

Measured before this existed (`benchmarks/probe_block_graph.py`, H100, `large`, 8K rows):
a block's eager forward + backward spent 44-66% of its wall on the host, and one graph
of it ran at the kernels' own time with bitwise the same output and gradients.

How: `graph_pair.capture_pair` (`torch.cuda.make_graphed_callables`'s capture, with the
parameters' gradients accumulated by multi-tensor kernels) on one callable, the whole
trunk (embedding out -> last block out, plus the auxiliary losses the blocks add),
captured for one packed layout (the spans of a micro-batch). Its inputs are the residual rows and the routing replay's
tensors, copied into the graph's static inputs on every call; the positions and the K/V
plan of the layout are bound at capture. Autograd sees one node: its backward replays the
backward graph and adds each block parameter's gradient into its `.grad`.

Invariants:
- Bitwise the eager trunk: the same kernels in the same order on the same inputs (the
  trunk has no host sync and no host-dependent branch once the layout is fixed). The
  auxiliary losses are summed over the blocks inside the trunk and added to the caller's
  collector once, on both paths, so the eager and graphed sums round alike.
- A layout is captured on its second sighting and replayed from its third: its first runs
  eagerly (compiling every kernel, naming the auxiliary losses). One captured layout is
  kept; another frees it. A trainer whose layouts never repeat stays eager.
- Capture leaves the model's state as it was: the warm-up calls of the capture run the
  blocks, so their buffers (expert loads, clamp counters) are restored afterwards.
- A deep copy of the model starts with no graphs (they replay this model's memory).
- Only where nothing else hooks the blocks: CUDA, bf16 compute, training, gradients on,
  no activation checkpointing, no tensor parallelism, no selection replay; `applies` says
  so, and the caller runs the eager trunk otherwise.
- Gradients accumulate over micro-batches as in the eager trunk: a graphed backward's
  gradients are added into (or copied into) `.grad` tensors of the trainer's own, never
  taken over as them, by a few multi-tensor kernels (`graph_pair.accumulate_gradients`).
  A layout whose capture would leave a block parameter without a gradient stays eager.
- A replay first brings the blocks' cached weight concatenations up to date
  (`Block.refresh_fused`: the MoE's [w1; w3], which the grouped SwiGLU reads in training
  too): the graphs read the buffers they captured, which an optimiser step since the
  capture would otherwise leave stale.
- A replay builds nothing on the host: the layout's eager trunk (positions, K/V plan) is
  built only to run eagerly or to capture (`TrunkBuilder`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from rlsys.model.attention import SeqSpan
from rlsys.model.aux import AuxLosses
from rlsys.model.graph_pair import capture_pair
from rlsys.model.routing import RoutedExperts, Routing, RoutingReplay

BlockRunner = Callable[[Tensor, RoutingReplay | None, AuxLosses | None], Tensor]
# builds the layout's eager trunk: (runner, the tensors it reads that a graph must keep)
TrunkBuilder = Callable[[], tuple[BlockRunner, tuple]]
# `graph_pair.capture_pair`'s signature, for the one call this module makes
Capture = Callable[..., Callable[..., tuple[Tensor, ...]]]


def _cuda_capture(call: nn.Module, sample: tuple[Tensor, ...], warmup: int) -> Callable:
    from rlsys.kernels.triton_ops import pdl

    # every block parameter must get a gradient (`capture_pair` refuses otherwise): see
    # `run`; with `pdl.TRUNK_GRAPHS` the Triton kernels of the forward and backward graphs
    # are captured with programmatic dependent launch (each starts while the one before it
    # ends)
    with pdl.dependent_launches(pdl.TRUNK_GRAPHS):
        return capture_pair(call, sample, warmup)


class _TrunkCall(nn.Module):
    """What a graph captures: (h, [indices, gates, [rows]]) -> (h, *aux losses by name)."""

    def __init__(
        self,
        blocks: nn.ModuleList,
        run: BlockRunner,
        replay: tuple[bool, bool] | None,
        aux_names: tuple[str, ...],
        want_aux: bool,
    ) -> None:
        super().__init__()
        self.blocks = blocks  # registered here only: their parameters are the graph's
        self._run, self._replay = run, replay
        self.aux_names, self._want_aux = aux_names, want_aux

    def forward(self, h: Tensor, *routes: Tensor) -> tuple[Tensor, ...]:
        aux = AuxLosses() if self._want_aux else None
        out = self._run(h, _replay_of(self._replay, routes), aux)
        values = aux.values if aux is not None else {}
        return (out, *(values[name] for name in self.aux_names))


@dataclass
class _Captured:
    key: tuple
    graphed: Callable[..., tuple[Tensor, ...]]
    aux_names: tuple[str, ...]
    keep: tuple  # the layout's tensors the graph reads (positions, K/V plan)


class TrunkGraphs:
    """Per model: the captured trunk of the last repeated layout, and the layouts seen."""

    def __init__(self, warmup: int = 2, remember: int = 256, capture: Capture = _cuda_capture):
        # `capture(call, sample, warmup)` -> the graphed call; CUDA's, but for a CPU test of
        # this bookkeeping, which stands in the eager call for the graph
        self.warmup, self.remember, self._capture = warmup, remember, capture
        self._seen: dict[tuple, tuple[str, ...]] = {}  # layout key -> its aux loss names
        self._eager_only: set[tuple] = set()  # layouts whose capture was refused
        self._captured: _Captured | None = None
        self.replays = 0  # graphed calls so far (a test and the bench read it)

    def clear(self) -> None:
        """Forget every layout and free the captured graphs (after a weight load)."""
        self._seen.clear()
        self._eager_only.clear()
        self._captured = None

    def __deepcopy__(self, memo: dict) -> TrunkGraphs:
        # a copied model (the reference policy, a scratch model) captures its own graphs:
        # these replay this model's parameters and memory
        return TrunkGraphs(self.warmup, self.remember, self._capture)

    @staticmethod
    def applies(
        model: nn.Module, tokens: Tensor, routing: Routing | None, recompute: bool, tp: int
    ) -> bool:
        """Whether the graphed trunk may stand in for the eager one on this call."""
        if not (tokens.is_cuda and model.training and torch.is_grad_enabled()):
            return False
        if model.dtype != torch.bfloat16:  # torch._grouped_mm in fp32 reads its offsets
            return False  # back to the host, which a capture refuses
        if recompute or tp != 1:
            return False
        if routing is None:
            return True
        return isinstance(routing, RoutingReplay) and routing.experts and not routing.blocks

    def run(
        self,
        blocks: nn.ModuleList,
        h: Tensor,
        spans: list[SeqSpan],
        routing: RoutingReplay | None,
        aux: AuxLosses | None,
        build: TrunkBuilder,
    ) -> Tensor:
        """The trunk's output rows for `h`. `build()` makes the eager trunk of this layout,
        `run(h, routing, aux)`, and names what it reads (its positions and K/V plan); a
        replay needs neither, so it is called only to run eagerly or to capture."""
        replay = _flags(routing)
        want_aux = aux is not None
        key = (tuple((s.row, s.n, s.pos) for s in spans), h.shape, replay, want_aux)
        routes = _route_inputs(routing, h.device)
        if self._captured is not None and self._captured.key == key:
            for block in blocks:  # the graphs read the cached concatenations they captured
                block.refresh_fused()
            outs = self._captured.graphed(h, *routes)
            self.replays += 1
            return _merge(outs, self._captured.aux_names, aux)
        run, layout = build()
        if key not in self._seen:  # first sighting: eager, and learn the aux loss names
            if len(self._seen) >= self.remember:  # layouts that never repeated: forget one
                del self._seen[next(iter(self._seen))]
            out, self._seen[key] = _eager(run, h, routing, routes, aux)
            return out
        names = self._seen[key]
        if key in self._eager_only:
            return _eager(run, h, routing, routes, aux)[0]
        self._captured = None  # free the last layout's graphs and their memory pool first
        call = _TrunkCall(blocks, run, replay, names, want_aux)
        saved = {name: buf.clone() for name, buf in blocks.named_buffers()}
        sample = (h.detach().clone().requires_grad_(h.requires_grad), *routes)
        try:
            graphed = self._capture(call, sample, self.warmup)
        except RuntimeError as exc:
            # A block parameter without a gradient here (the indexer's, when no aux loss
            # trains it): the graph's backward has no gradient to give it, where the eager
            # trunk's leaves its `.grad` None. This layout stays eager.
            if "not have been used" not in str(exc):
                raise
            self._eager_only.add(key)
            _restore(blocks, saved)
            return _eager(run, h, routing, routes, aux)[0]
        _restore(blocks, saved)
        self._captured = _Captured(key, graphed, names, layout)
        outs = graphed(h, *routes)
        self.replays += 1
        return _merge(outs, names, aux)


def _restore(blocks: nn.ModuleList, saved: dict[str, Tensor]) -> None:
    """The blocks' buffers as they were before a capture's warm-up calls ran the blocks."""
    with torch.no_grad():
        for name, buf in blocks.named_buffers():
            buf.copy_(saved[name])


def _eager(
    run: BlockRunner,
    h: Tensor,
    routing: RoutingReplay | None,
    routes: tuple[Tensor, ...],
    aux: AuxLosses | None,
) -> tuple[Tensor, tuple[str, ...]]:
    """The eager trunk's rows and the names of its aux losses, which are summed over the
    blocks inside and added to `aux` once each (as a graph's are)."""
    inner = AuxLosses() if aux is not None else None
    out = run(h, _replay_of(_flags(routing), routes), inner)
    names = tuple(inner.values) if inner is not None else ()
    values = tuple(inner.values[n] for n in names) if inner is not None else ()
    return _merge((out, *values), names, aux), names


def _route_inputs(routing: RoutingReplay | None, dev: torch.device) -> tuple[Tensor, ...]:
    if routing is None:
        return ()
    parts = [routing.routes.indices, routing.routes.gates]
    if routing.rows is not None:
        parts.append(routing.rows)
    return tuple(p.to(dev) for p in parts)


def _flags(routing: RoutingReplay | None) -> tuple[bool, bool] | None:
    """What of a replay is not a tensor: (gates used, rows given); None without replay."""
    return None if routing is None else (routing.use_gates, routing.rows is not None)


def _replay_of(flags: tuple[bool, bool] | None, routes: tuple[Tensor, ...]) -> RoutingReplay | None:
    """The replay a graphed call builds from its route inputs (an eager call too, so both
    paths read the same tensors through the same object)."""
    if flags is None:
        return None
    use_gates, has_rows = flags
    rows = routes[2] if has_rows else None
    return RoutingReplay(RoutedExperts(routes[0], routes[1]), use_gates, rows)


def _merge(outs: tuple[Tensor, ...], names: tuple[str, ...], aux: AuxLosses | None) -> Tensor:
    """The trunk's rows; its auxiliary losses added to the caller's collector, once each."""
    if aux is not None:
        for name, value in zip(names, outs[1:], strict=True):
            aux.add(name, value)
    return outs[0]
