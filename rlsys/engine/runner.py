"""Model runners: what the scheduler calls to run one packed forward step.

A runner owns the weights and every sequence's `ModelCache`, addressed by integer keys, so
the scheduler never touches tensors of the model: the same scheduler drives one local model
(`LocalRunner`), TP shards as threads, or TP shards as gloo processes (`rlsys.engine.tp_*`).

Invariants:
- `step` feeds chunk i to cache keys[i] in ONE `forward_step` (prefill and decode rows
  packed together) and returns, per chunk, the fp32 logits of its last row, on the CPU.
- `fork_cache` is a snapshot that keeps its length while the original grows. Reference
  caches are never written in place (appends build new tensors, trims take views), so a
  shallow copy shares storage safely; paged caches (the Triton path, on CUDA) share full
  pages by reference count and copy only the partial last page (`PagePool.fork`).
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from rlsys.config.model import ModelConfig
from rlsys.engine.decode_graphs import DecodeGraphs
from rlsys.kernels.dispatch import use_triton
from rlsys.model import ModelCache, RoutedExperts, RoutingRecorder, Transformer
from rlsys.model.paged_cache import PagedSeqCache, PagePool


@dataclass
class StepOutput:
    last_logits: Tensor  # (n_chunks, V) fp32, on the model's device (see sampler.py)
    routes: RoutedExperts | None  # routes of all packed rows, chunk after chunk


class ModelRunner(Protocol):
    def new_cache(self) -> int: ...
    def fork_cache(self, key: int) -> int: ...
    def free_cache(self, key: int) -> None: ...
    def step(self, keys: list[int], chunks: list[list[int]]) -> StepOutput: ...
    def load_state_dict(self, state: Mapping[str, Tensor]) -> None: ...
    def close(self) -> None: ...


def snapshot(cache: ModelCache) -> ModelCache:
    """A copy that shares tensors (see module doc: caches are never written in place)."""
    return ModelCache([copy.copy(layer) for layer in cache.layers], cache.length)


class CacheTable:
    """Key -> sequence cache (per-layer `ModelCache`, or pages of the model's `PagePool`)."""

    def __init__(
        self, model: Transformer, device: torch.device, record_selections: bool = False
    ) -> None:
        self.model, self.device = model, device
        self.record_selections = record_selections
        self.caches: dict[int, ModelCache | PagedSeqCache] = {}
        self._keys = itertools.count()

    def new(self) -> int:
        key = next(self._keys)
        self.caches[key] = self.model.new_cache(self.device)
        return key

    def fork(self, key: int) -> int:
        new = next(self._keys)
        cache = self.caches[key]
        pool = self.model.page_pool
        self.caches[new] = (
            pool.fork(cache) if isinstance(cache, PagedSeqCache) and pool else snapshot(cache)
        )  # type: ignore[arg-type]
        return new

    def free(self, key: int) -> None:
        cache = self.caches.pop(key, None)
        if isinstance(cache, PagedSeqCache) and self.model.page_pool is not None:
            self.model.page_pool.free(cache)

    def forward(
        self, keys: list[int], chunks: list[list[int]], record: bool
    ) -> tuple[list[Tensor], RoutedExperts | None]:
        tensors = [torch.tensor(c, dtype=torch.long, device=self.device) for c in chunks]
        recorder = RoutingRecorder(blocks=self.record_selections) if record else None
        with torch.inference_mode():
            logits = self.model.forward_step(
                tensors, [self.caches[k] for k in keys], routing=recorder
            )
        return logits, recorder.routes() if recorder is not None else None


class LocalRunner:
    """TP=1: the whole model in this process (CPU or one GPU)."""

    def __init__(
        self,
        cfg: ModelConfig,
        state: Mapping[str, Tensor] | None,
        device: str = "cpu",
        kv_pages: int = 0,
        page_tokens: int = 64,
        record_selections: bool = False,
    ) -> None:
        self.device = torch.device(device)
        model = Transformer(cfg).eval()
        if state is not None:
            model.load_state_dict(state)
        self.model = model.to(self.device)
        attach_pool(self.model, self.device, kv_pages, page_tokens)
        self.table = CacheTable(self.model, self.device, record_selections)
        self.graphs: DecodeGraphs | None = None

    def enable_decode_graphs(self, max_batch: int, max_context: int) -> None:
        """Run decode-only steps through `DecodeGraphs` (captured on CUDA; on the CPU the
        same fixed-shape step runs eagerly, as the tests use it). Needs the paged cache."""
        if self.model.page_pool is None:
            raise ValueError("decode graphs need the paged KV cache (kv_pages > 0, Triton path)")
        capture = self.device.type == "cuda"
        self.graphs = DecodeGraphs(self.model, max_batch, max_context, capture)

    def new_cache(self) -> int:
        return self.table.new()

    def fork_cache(self, key: int) -> int:
        return self.table.fork(key)

    def free_cache(self, key: int) -> None:
        self.table.free(key)

    def step(self, keys: list[int], chunks: list[list[int]]) -> StepOutput:
        if self.graphs is not None and all(len(c) == 1 for c in chunks):
            caches = [self.table.caches[k] for k in keys]
            if self.graphs.fits(caches):  # type: ignore[arg-type]
                last, graph_routes = self.graphs.run([c[0] for c in chunks], caches)  # type: ignore[arg-type]
                return StepOutput(last, routes_to_cpu(graph_routes))
        logits, routes = self.table.forward(keys, chunks, record=True)
        # Left on the model's device: the recorded log-prob is computed there, where the
        # trainer recomputes it (exp/log differ in the last bit between CPU and GPU).
        last = torch.stack([rows[-1] for rows in logits]).float()
        return StepOutput(last, routes_to_cpu(routes))

    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        self.model.load_state_dict(state)

    def close(self) -> None:
        for key in list(self.table.caches):
            self.table.free(key)


def attach_pool(
    model: Transformer, device: torch.device, kv_pages: int, page_tokens: int = 64
) -> None:
    """Give a model on the Triton path (CUDA) its paged KV pool; the CPU keeps per-seq caches."""
    if kv_pages and use_triton(torch.empty(0, device=device)):
        pool = PagePool(
            model.cfg,
            page_size=page_tokens,
            sparse_pages=kv_pages,
            swa_pages=kv_pages,
            dtype=model.dtype,
            device=device,
        )
        model.attach_page_pool(pool)


def routes_to_cpu(routes: RoutedExperts | None) -> RoutedExperts | None:
    return routes.to("cpu") if routes is not None else None
