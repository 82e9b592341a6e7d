"""A module's forward and backward captured as two CUDA graphs, its parameters' gradients
added into their `.grad` by a few multi-tensor kernels rather than one kernel each.

`torch.cuda.make_graphed_callables` hands each parameter's gradient back to autograd, whose
`AccumulateGrad` then adds it into `.grad` with one kernel per parameter (259 per step for
`large` cut to 8 blocks: 3% of a graphed 2 x 8K step's GPU time, and before this each had to
be given a `.grad` filled with -0.0 first, see below). Here the replay's backward returns no
gradient for the parameters: `accumulate_gradients` adds the backward graph's static
gradients into the `.grad`s that exist with one `_foreach_add_`, and copies them into fresh
storage (one flat buffer per dtype, every new `.grad` a view of it) with one
`_foreach_copy_` where there is none yet. Otherwise the capture is `make_graphed_callables`'s
for one callable: warm-up calls on a side stream, the forward captured, then the backward
through `torch.autograd.grad` into one memory pool.

Invariants:
- The gradients are the ones autograd would have accumulated, bitwise: a parameter without
  `.grad` gets exactly the backward's gradient (a copy, never the static buffer itself: the
  next replay overwrites that, PyTorch issue 181723), one with a `.grad` gets `.grad + g`
  elementwise, as `AccumulateGrad`'s in-place add does.
- Every parameter must receive a gradient (`allow_unused=False`): one that would not raises
  the RuntimeError autograd raises (its message says "not have been used"), and the caller
  runs eagerly.
- The parameters are inputs of the replay's autograd node (so its outputs require gradients
  whenever a parameter does, as with `make_graphed_callables`), but their gradients never
  pass through autograd: nothing hooked on a parameter's `AccumulateGrad` runs. Only the
  trunk's graphs use this, and only without data parallelism (`TrunkGraphs.applies`, the
  config's check), which is where such hooks would live.
- A replay copies a user input into its static twin unless it already is it, as the torch
  helper does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable


def accumulate_gradients(params: Sequence[nn.Parameter], grads: Sequence[Tensor]) -> None:
    """Add each gradient into its parameter's `.grad`, or give the parameter a copy of it."""
    held = [(p.grad, g) for p, g in zip(params, grads, strict=True) if p.grad is not None]
    if held:
        torch._foreach_add_([a for a, _ in held], [g for _, g in held])
    fresh: dict[tuple[torch.dtype, torch.device], list[tuple[nn.Parameter, Tensor]]] = {}
    for p, g in zip(params, grads, strict=True):
        if p.grad is None:
            fresh.setdefault((g.dtype, g.device), []).append((p, g))
    for (dtype, device), pairs in fresh.items():
        flat = torch.empty(sum(g.numel() for _, g in pairs), dtype=dtype, device=device)
        views, start = [], 0
        for p, g in pairs:
            views.append(flat[start : start + g.numel()].view_as(p))
            start += g.numel()
        torch._foreach_copy_(views, [g for _, g in pairs])
        for (p, _), view in zip(pairs, views, strict=True):
            p.grad = view


@dataclass
class _Pair:
    fwd: torch.cuda.CUDAGraph
    bwd: torch.cuda.CUDAGraph
    inputs: tuple[Tensor, ...]  # static inputs (the sample)
    outputs: tuple[Tensor, ...]  # static outputs of the forward graph
    grad_outputs: tuple[Tensor | None, ...]  # static incoming gradients, one per output
    input_grads: tuple[Tensor | None, ...]  # the backward's gradient per input (None: none)
    params: tuple[nn.Parameter, ...]
    param_grads: tuple[Tensor, ...]  # the backward's static gradient per parameter


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, pair: _Pair, *inputs: Tensor) -> tuple[Tensor, ...]:
        for static, x in zip(pair.inputs, inputs[: len(pair.inputs)], strict=True):
            if static.data_ptr() != x.data_ptr():
                static.copy_(x)
        pair.fwd.replay()
        ctx.pair = pair
        return tuple(o.detach() for o in pair.outputs)

    @staticmethod
    @once_differentiable
    def backward(ctx: object, *grads: Tensor) -> tuple[Tensor | None, ...]:
        pair: _Pair = ctx.pair
        for static, g in zip(pair.grad_outputs, grads, strict=True):
            if static is not None and static.data_ptr() != g.data_ptr():
                static.copy_(g)
        pair.bwd.replay()
        accumulate_gradients(pair.params, pair.param_grads)
        inputs = tuple(g.detach() if g is not None else None for g in pair.input_grads)
        return (None, *inputs, *(None for _ in pair.params))


class GraphedCall:
    """`module(*inputs)` replayed: the outputs of the forward graph, with a backward."""

    def __init__(self, pair: _Pair) -> None:
        self._pair = pair

    def __call__(self, *inputs: Tensor) -> tuple[Tensor, ...]:
        return _Replay.apply(self._pair, *inputs, *self._pair.params)


def capture_pair(module: nn.Module, sample: tuple[Tensor, ...], warmup: int) -> GraphedCall:
    """Capture `module(*sample)` (a tuple of tensors out) and its backward as CUDA graphs;
    `sample` becomes the static inputs."""
    params = tuple(p for p in module.parameters() if p.requires_grad)
    wanted_inputs = tuple(x for x in sample if x.requires_grad)

    def grads_of(outputs: tuple[Tensor, ...], grad_outputs: list[Tensor]) -> tuple:
        differentiable = [o for o in outputs if o.requires_grad]
        return torch.autograd.grad(
            differentiable, wanted_inputs + params, grad_outputs, only_inputs=True,
            allow_unused=False,
        )  # fmt: skip

    torch.cuda.synchronize()
    with torch.cuda.stream(torch.cuda.Stream()):  # lazy initialisation stays out of capture
        for _ in range(warmup):
            outs = module(*sample)
            grads_of(outs, [torch.empty_like(o) for o in outs if o.requires_grad])
            del outs
    torch.cuda.synchronize()
    pool = torch.cuda.graph_pool_handle()
    fwd, bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(fwd, pool=pool):
        outputs = tuple(module(*sample))
    grad_outputs = tuple(torch.empty_like(o) if o.requires_grad else None for o in outputs)
    with torch.cuda.graph(bwd, pool=pool):
        grads = grads_of(outputs, [g for g in grad_outputs if g is not None])
    by_input = iter(grads[: len(wanted_inputs)])
    input_grads = tuple(next(by_input) if x.requires_grad else None for x in sample)
    pair = _Pair(
        fwd, bwd, sample, outputs, grad_outputs, input_grads, params,
        tuple(grads[len(wanted_inputs) :]),
    )  # fmt: skip
    return GraphedCall(pair)
