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
  graphs stay valid across weight updates; the fused weights the graphs read
  (`rlsys.model.fused_weights`) are refreshed before the first replay after a load.
- Off CUDA (`capture=False`, the CPU tests under Triton's interpreter) the same static step
  runs eagerly, which is how the layout is tested without a GPU.
- With a sampler (`sampler=(candidate cap, sample vocab)`), the graph also draws every
  row's token (`sampler.sample_rows` over static parameter buffers), so the whole step,
  sampling included, is one replay and one host copy of its results; a token is what
  `sample_batch` would draw from the same logits with the same uniform.
- With `pdl.DECODE_GRAPHS` the step's Triton kernels launch with programmatic dependent
  launch where the GPU has it (`rlsys.kernels.triton_ops.pdl`): each one's grid starts
  while the kernel before it finishes and waits for it on the device; the same bits.
- A step may be fed the tokens a previous step drew, still on the device (`launch(fed=)`),
  before the host has read them: the engine queues the next decode step behind the
  previous one (`rlsys.engine.core`, overlap). The copy into the layout's token buffer is
  queued before the replay, so stream order gives it the drawn values. A row fed that way
  whose sequence ended at the previous token is taken back (`retract`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from rlsys.engine.sampler import (
    RowParams,
    RowTensors,
    SampledToken,
    SampleOut,
    draw_uniforms,
    sample_rows,
)
from rlsys.kernels.host_to_device import CopyFence
from rlsys.model import RoutedExperts, RoutingRecorder, Transformer
from rlsys.model.decode_layout import StaticDecodeLayout, scratch_pages
from rlsys.model.paged_cache import PagedSeqCache

BATCH_LADDER = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
FIRST_BUCKET = 1024  # context buckets: 1K, 4K, 16K, ... (x4), capped at the engine's limit


class SamplingBuffers:
    """Fixed buffers of a graph's per-row sampling parameters (padding rows: a harmless
    default), filled from the host with one copy per step.

    Per step only the draws change while the batch's rows stay the same sequences, so the
    parameter rows are rewritten only when the rows (`RowParams`, one object per sequence
    for its life) differ from the last fill's; the rows' uniforms (`draw_uniforms`) are
    written into the host buffer in one op."""

    def __init__(self, batch: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.host = torch.zeros(5, batch, dtype=torch.float64, pin_memory=pin)
        self.dev = torch.zeros(5, batch, dtype=torch.float64, device=device)
        self._copied = CopyFence(pin)  # the host buffer is rewritten once the device read it
        self._rows: list[RowParams] | None = None  # whose parameters the buffer holds
        self.fill([])

    def tensors(self) -> RowTensors:
        d = self.dev
        return RowTensors(d[0].float(), d[1].long(), d[2], d[3].long(), d[4])

    def fill(self, rows: list[RowParams]) -> None:
        self._copied.wait()
        h, n = self.host, len(rows)
        if not self._same_rows(rows):
            h[:, n:] = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5], dtype=torch.float64)[:, None]
            if n:
                h[:4, :n] = torch.tensor(
                    [(r.params.temperature, r.params.top_k, r.params.top_p, r.cap) for r in rows],
                    dtype=torch.float64,
                ).T
            self._rows = list(rows)
        if n:
            h[4, :n] = torch.tensor(draw_uniforms(rows), dtype=torch.float64)
        self.dev.copy_(h, non_blocking=True)
        self._copied.mark()

    def _same_rows(self, rows: list[RowParams]) -> bool:
        last = self._rows
        return (
            last is not None
            and len(last) == len(rows)
            and all(a is b for a, b in zip(last, rows, strict=True))
        )


@dataclass
class _Graph:
    layout: StaticDecodeLayout
    logits: Tensor  # (B, V) fp32, overwritten by every replay
    indices: Tensor | None  # (L, B, k) routed experts
    gates: Tensor | None
    graph: torch.cuda.CUDAGraph | None  # None: run eagerly (no CUDA)
    params: SamplingBuffers | None = None
    sampled: SampleOut | None = None


@dataclass
class Launched:
    """A decode step replayed, its results on their way to the host."""

    logits: Tensor  # (n, V) fp32 on the device
    host: list[Tensor]  # [indices, gates] when routed, then the packed draws when drawn
    drew: bool
    done: torch.cuda.Event | None  # recorded after the copies (None off CUDA)
    # the drawn tokens (n,) on the device, in the graph's output buffer: valid for a step
    # queued behind this one (stream order), overwritten by this graph's next replay
    tokens: Tensor | None = None


class DecodeGraphs:
    """Captured decode steps of one model and its page pool (see module doc)."""

    def __init__(
        self,
        model: Transformer,
        max_batch: int,
        max_context: int,
        capture: bool,
        sampler: tuple[int, int | None] | None = None,
    ) -> None:
        assert model.page_pool is not None, "decode graphs read the paged KV cache"
        self.model, self.pool, self.capture = model, model.page_pool, capture
        self.sampler = sampler  # (candidate columns, sample vocab), or no sampling
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
        self.draws = 0  # of which the graph also sampled
        # the model's weights generation the captured fused weights hold
        self.generation = model.weights_generation
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
        self,
        tokens: list[int],
        caches: list[PagedSeqCache],
        sampling: list[RowParams] | None = None,
    ) -> tuple[Tensor, RoutedExperts | None, list[SampledToken] | None]:
        """Feed each sequence its next token: fp32 logits (n, V), routes (L, n, k), and,
        given `sampling` (one row per sequence) and a sampler, each row's drawn token."""
        return self.collect(self.launch(tokens, caches, sampling))

    def launch(
        self,
        tokens: list[int],
        caches: list[PagedSeqCache],
        sampling: list[RowParams] | None = None,
        fed: Tensor | None = None,
    ) -> Launched:
        """`run`'s first half: the step is replayed and its results start for the host;
        `collect` waits for them. Between the two the host may do other work while the GPU
        runs the step (the engine writes the previous step's records then). `fed`: the
        rows' tokens (n,) int64 on the device (a previous step's draws), read in place of
        `tokens`."""
        n = len(tokens)
        batch = next(b for b in self.ladder if b >= n)
        longest = max(c.length for c in caches)
        bucket = next(b for b in self.buckets if longest < b)
        g = self.graphs.get((batch, bucket)) or self._build(batch, bucket)
        g.layout.fill(tokens, caches)
        if fed is not None:  # queued after the fill's copy, before the replay
            g.layout.tokens[:n].copy_(fed)
        draw = sampling is not None and g.params is not None
        if draw:
            assert g.params is not None and sampling is not None and len(sampling) == n
            g.params.fill(sampling)
        if g.graph is not None:
            if self.generation != self.model.weights_generation:  # weights loaded since
                self.model.refresh_fused()
                self.generation = self.model.weights_generation
            g.graph.replay()
        else:
            g.logits, g.indices, g.gates, g.sampled = self._forward(g.layout, g.params)
        g.layout.advance(caches)
        self.steps += 1
        # copies out of the graph's buffers (the next replay overwrites them), then to the
        # host without waiting; `collect` waits on the event
        logits = g.logits[:n].clone()
        host: list[Tensor] = []
        if g.indices is not None and g.gates is not None:
            host += [g.indices[:, :n].to("cpu", non_blocking=True)]
            host += [g.gates[:, :n].to("cpu", non_blocking=True)]
        if draw and g.sampled is not None:
            host.append(g.sampled.packed(n).to("cpu", non_blocking=True))
            self.draws += 1
        done = torch.cuda.Event() if logits.is_cuda else None
        if done is not None:
            done.record()
        drew = draw and g.sampled is not None
        drawn = g.sampled.tokens[:n] if drew and g.sampled is not None else None
        return Launched(logits, host, drew, done, drawn)

    def retract(self, cache: PagedSeqCache) -> None:
        """Take back the newest row of `cache` (fed by a step queued before its sequence was
        seen to end): its length drops by one; the row's K/V stay in the page, past the
        length, and the next row written there replaces them. Safe with the window trim:
        trimming at length L + 1 frees only pages a query at position L never reads."""
        assert cache.length > 0
        cache.length -= 1

    def collect(
        self, step: Launched
    ) -> tuple[Tensor, RoutedExperts | None, list[SampledToken] | None]:
        """Wait for a launched step's results (fp32 logits on the device, routes and drawn
        tokens on the host)."""
        if step.done is not None:
            step.done.synchronize()
        host = list(step.host)
        routes = RoutedExperts(host.pop(0), host.pop(0)) if len(host) >= 2 else None
        sampled = SampleOut.unpack(host.pop(0)) if step.drew else None
        return step.logits, routes, sampled

    def _forward(
        self, layout: StaticDecodeLayout, params: SamplingBuffers | None
    ) -> tuple[Tensor, Tensor | None, Tensor | None, SampleOut | None]:
        from rlsys.kernels.triton_ops import pdl  # triton: imported where a step is built

        recorder = RoutingRecorder()
        with torch.inference_mode(), pdl.dependent_launches(pdl.DECODE_GRAPHS):
            logits = self.model.forward_decode(layout.tokens, layout.positions, layout.kv, recorder)
            sampled = None
            if params is not None and self.sampler is not None:
                width, vocab = self.sampler
                v = logits.shape[1]
                sampled = sample_rows(logits, params.tensors(), min(width, v), v, vocab)
        if not recorder.layers:  # a model without MoE layers records no routes
            return logits, None, None, sampled
        routes = recorder.routes()
        return logits, routes.indices, routes.gates, sampled

    def _build(self, batch: int, bucket: int) -> _Graph:
        started = time.perf_counter()
        layout = StaticDecodeLayout(self.model.cfg, self.pool, batch, bucket - 1, self.scratch)
        layout.fill([], [])  # padding rows only: warm-up and capture write the scratch pages
        params = SamplingBuffers(batch, self.pool.device) if self.sampler is not None else None
        # compiles the kernels for this shape (and builds what the forward caches)
        logits, indices, gates, sampled = self._forward(layout, params)
        graph = None
        if self.capture:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._forward(layout, params)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.mempool):
                logits, indices, gates, sampled = self._forward(layout, params)
            torch.cuda.synchronize()
        built = _Graph(layout, logits, indices, gates, graph, params, sampled)
        self.graphs[(batch, bucket)] = built
        self.capture_s += time.perf_counter() - started
        return built
