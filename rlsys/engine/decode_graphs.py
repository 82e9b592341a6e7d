"""Decode steps replayed as CUDA graphs, at a ladder of batch sizes and context buckets.

Why: an eager decode step of `medium` launches ~2,500 kernels from Python; on an H200 the
host takes ~60 ms per step against ~7 ms of GPU work. A graph replays the whole step's
launches in one call. (nano-vllm captures decode the same way.)

How: a decode-only step of n sequences runs in the graph of the smallest captured batch
size >= n and the smallest context bucket that holds every sequence's next position. Its
`StaticDecodeLayout` is filled from the host (two host->device copies), the graph replays,
and the step's logits and routes are read from the graph's static outputs. The graphs share
one memory pool (they never run concurrently, and each keeps its outputs alive).
`capture_all` captures every (batch, bucket) pair up front, largest first so that smaller
graphs reuse the pool's blocks (the engine does this at start-up by default: a capture
is a 0.2-1.7 s stall that would otherwise land in the middle of generation); a pair not yet
captured is captured the first time it is needed.

Invariants:
- A token's logits and routes are bitwise what the eager `forward_step` gives it (see
  `StaticDecodeLayout`): the graph only removes the host from the step.
- Weights are updated in place (`load_state_dict` copies into the captured parameters), so
  graphs stay valid across weight updates.
- Off CUDA (`capture=False`, the CPU tests under Triton's interpreter) the same static step
  runs eagerly, which is how the layout is tested without a GPU.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from rlsys.model import RoutedExperts, RoutingRecorder, Transformer
from rlsys.model.decode_layout import StaticDecodeLayout, scratch_pages
from rlsys.model.paged_cache import PagedSeqCache

BATCH_LADDER = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
FIRST_BUCKET = 1024  # context buckets: 1K, 4K, 16K, ... (x4), capped at the engine's limit


@dataclass
class _Graph:
    layout: StaticDecodeLayout
    logits: Tensor  # (B, V) fp32, overwritten by every replay
    indices: Tensor | None  # (L, B, k) routed experts
    gates: Tensor | None
    graph: torch.cuda.CUDAGraph | None  # None: run eagerly (no CUDA)


class DecodeGraphs:
    """Captured decode steps of one model and its page pool (see module doc)."""

    def __init__(self, model: Transformer, max_batch: int, max_context: int, capture: bool) -> None:
        assert model.page_pool is not None, "decode graphs read the paged KV cache"
        self.model, self.pool, self.capture = model, model.page_pool, capture
        self.ladder = [b for b in BATCH_LADDER if b < max_batch] + [max_batch]
        page = self.pool.page_size
        buckets, c = [], FIRST_BUCKET
        while c < max_context:
            buckets.append(c)
            c *= 4
        # a bucket spans whole pages: its table reaches every position below it
        self.buckets = [-(-b // page) * page for b in [*buckets, max_context]]
        self.scratch = scratch_pages(self.pool)
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.mempool = torch.cuda.graph_pool_handle() if capture else None
        self.steps = 0  # decode steps served (a graph replay each, on CUDA)
        self.capture_s = 0.0  # wall time spent building graphs (captures and their warm-ups)

    def capture_all(self) -> int:
        """Build the graph of every (batch, bucket) pair not built yet, largest first;
        returns how many were built."""
        todo = [
            (b, c)
            for c in reversed(self.buckets)
            for b in reversed(self.ladder)
            if (b, c) not in self.graphs
        ]
        for batch, bucket in todo:
            self._build(batch, bucket)
        return len(todo)

    def fits(self, caches: list[PagedSeqCache]) -> bool:
        """Whether a decode step of these sequences has a graph size (else: run eagerly)."""
        return 0 < len(caches) <= self.ladder[-1] and all(
            c.length < self.buckets[-1] for c in caches
        )

    def run(
        self, tokens: list[int], caches: list[PagedSeqCache]
    ) -> tuple[Tensor, RoutedExperts | None]:
        """Feed each sequence its next token: fp32 logits (n, V) and routes (L, n, k)."""
        n = len(tokens)
        batch = next(b for b in self.ladder if b >= n)
        longest = max(c.length for c in caches)
        bucket = next(b for b in self.buckets if longest < b)
        g = self.graphs.get((batch, bucket)) or self._build(batch, bucket)
        g.layout.fill(tokens, caches)
        if g.graph is not None:
            g.graph.replay()
        else:
            g.logits, g.indices, g.gates = self._forward(g.layout)
        g.layout.advance(caches)
        self.steps += 1
        routes = None
        if g.indices is not None and g.gates is not None:
            routes = RoutedExperts(g.indices[:, :n].clone(), g.gates[:, :n].clone())
        return g.logits[:n].clone(), routes

    def _forward(self, layout: StaticDecodeLayout) -> tuple[Tensor, Tensor | None, Tensor | None]:
        recorder = RoutingRecorder()
        with torch.inference_mode():
            logits = self.model.forward_decode(layout.tokens, layout.positions, layout.kv, recorder)
        if not recorder.layers:  # a model without MoE layers records no routes
            return logits, None, None
        routes = recorder.routes()
        return logits, routes.indices, routes.gates

    def _build(self, batch: int, bucket: int) -> _Graph:
        started = time.perf_counter()
        layout = StaticDecodeLayout(self.model.cfg, self.pool, batch, bucket - 1, self.scratch)
        layout.fill([], [])  # padding rows only: warm-up and capture write the scratch pages
        logits, indices, gates = self._forward(layout)  # compiles the kernels for this shape
        graph = None
        if self.capture:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._forward(layout)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.mempool):
                logits, indices, gates = self._forward(layout)
            torch.cuda.synchronize()
        built = _Graph(layout, logits, indices, gates, graph)
        self.graphs[(batch, bucket)] = built
        self.capture_s += time.perf_counter() - started
        return built
