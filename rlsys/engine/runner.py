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
- Speculative decoding (`LocalRunner(speculative_tokens=k)`, reference caches only): `step`
  keeps a snapshot of each stepped cache, so `truncate_cache` can roll back the rows of
  rejected drafts (`rlsys.model.cache_rollback`); the drafter gets every fed row's hidden.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from rlsys.config.model import ModelConfig
from rlsys.engine.decode_graphs import DecodeGraphs
from rlsys.engine.mtp_drafter import Drafter
from rlsys.engine.sampler import RowParams, SampledToken
from rlsys.kernels.dispatch import use_triton
from rlsys.model import ModelCache, RoutedExperts, RoutingRecorder, Transformer
from rlsys.model.cache_rollback import rollback
from rlsys.model.paged_cache import PagedSeqCache, PagePool


@dataclass
class StepOutput:
    last_logits: Tensor  # (n_chunks, V) fp32, on the model's device (see sampler.py)
    routes: RoutedExperts | None  # routes of all packed rows, chunk after chunk
    row_logits: list[Tensor] | None = None  # per chunk (n_i, V): every row (LocalRunner)
    # per chunk, the token drawn from its last row, when the step sampled on the device
    # (decode graphs given `sampling`); None: the caller samples `last_logits`
    sampled: list[SampledToken] | None = None


@dataclass
class LaunchedStep:
    """A decode step on the device (`LocalRunner.launch`): `collect` waits for its output;
    `tokens` are its rows' drawn tokens on the device (None: the step did not draw), which
    a step launched after it may be fed before the host reads them."""

    collect: Callable[[], StepOutput]
    tokens: Tensor | None


class ModelRunner(Protocol):
    def new_cache(self) -> int: ...
    def fork_cache(self, key: int) -> int: ...
    def free_cache(self, key: int) -> None: ...
    def step(
        self, keys: list[int], chunks: list[list[int]], sampling: list[RowParams] | None = None
    ) -> StepOutput: ...
    def load_state_dict(self, state: Mapping[str, Tensor]) -> None: ...
    def close(self) -> None: ...


class DraftingRunner(ModelRunner, Protocol):
    """A runner that drafts with the MTP heads and rolls back rejected rows."""

    def draft(self, keys: list[int], tokens: list[list[int]]) -> list[list[int]]: ...
    def truncate_cache(self, key: int, length: int) -> None: ...


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
        logits, _, routes = self.forward_hidden(keys, chunks, record)
        return logits, routes

    def forward_hidden(
        self, keys: list[int], chunks: list[list[int]], record: bool
    ) -> tuple[list[Tensor], list[Tensor], RoutedExperts | None]:
        """`forward`, plus each chunk's final hidden rows."""
        tensors = [torch.tensor(c, dtype=torch.long, device=self.device) for c in chunks]
        recorder = RoutingRecorder(blocks=self.record_selections) if record else None
        with torch.inference_mode():
            logits, hidden = self.model.forward_step_hidden(
                tensors, [self.caches[k] for k in keys], routing=recorder
            )
        return logits, hidden, recorder.routes() if recorder is not None else None


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
        speculative_tokens: int = 0,
        sample_vocab: int | None = None,
    ) -> None:
        self.device = torch.device(device)
        model = Transformer(cfg).eval()
        if state is not None:
            model.load_state_dict(state)
        self.model = model.to(self.device)
        attach_pool(self.model, self.device, kv_pages, page_tokens)
        self.table = CacheTable(self.model, self.device, record_selections)
        self.sample_vocab = sample_vocab
        self.drafter = (
            Drafter(self.model, speculative_tokens, sample_vocab) if speculative_tokens else None
        )
        self._before: dict[int, ModelCache] = {}  # snapshots of the last step (spec only)
        self.graphs: DecodeGraphs | None = None

    def enable_decode_graphs(
        self,
        max_batch: int,
        max_context: int,
        at_start: bool = False,
        candidates: int | None = None,
    ) -> None:
        """Run decode-only steps through `DecodeGraphs` (captured on CUDA; on the CPU the
        same fixed-shape step runs eagerly, as the tests use it). Needs the paged cache.
        `at_start`: build every graph now rather than on first use. `candidates` (the
        engine's candidate cap): the graphs also sample (`sampler.sample_rows`), so a
        decode step given `sampling` rows returns its tokens after one host copy."""
        if self.model.page_pool is None:
            raise ValueError("decode graphs need the paged KV cache (kv_pages > 0, Triton path)")
        if self.drafter is not None:
            raise ValueError("decode graphs and speculative decoding exclude each other")
        capture = self.device.type == "cuda"
        sampler = (candidates, self.sample_vocab) if candidates is not None else None
        self.graphs = DecodeGraphs(self.model, max_batch, max_context, capture, sampler)
        if at_start:
            self.graphs.capture_all()

    def new_cache(self) -> int:
        key = self.table.new()
        if self.drafter is not None:
            self.drafter.new(key, self.device)
        return key

    def fork_cache(self, key: int) -> int:
        new = self.table.fork(key)
        if self.drafter is not None:
            self.drafter.fork(key, new)
        return new

    def free_cache(self, key: int) -> None:
        self.table.free(key)
        self._before.pop(key, None)
        if self.drafter is not None:
            self.drafter.free(key)

    def launch(
        self,
        keys: list[int],
        chunks: list[list[int]],
        sampling: list[RowParams] | None = None,
        fed: Tensor | None = None,
    ) -> LaunchedStep | None:
        """Start a decode step that a decode graph serves (`step` = launch, then collect);
        None when the step is not one (run `step`). `fed`: the rows' tokens on the device
        (a launched step's `tokens`), read in place of `chunks`' (see `DecodeGraphs`)."""
        if self.graphs is None or not all(len(c) == 1 for c in chunks):
            return None
        caches = [self.table.caches[k] for k in keys]
        if not self.graphs.fits(caches):  # type: ignore[arg-type]
            return None
        graphs = self.graphs
        launched = graphs.launch([c[0] for c in chunks], caches, sampling, fed)  # type: ignore[arg-type]

        def collect() -> StepOutput:
            last, routes, sampled = graphs.collect(launched)
            return StepOutput(last, routes, None, sampled)

        return LaunchedStep(collect, launched.tokens)

    def retract(self, key: int) -> None:
        """Drop the newest row of cache `key`, fed by a launched step whose sequence ended
        before it (`DecodeGraphs.retract`)."""
        cache = self.table.caches[key]
        assert self.graphs is not None and isinstance(cache, PagedSeqCache)
        self.graphs.retract(cache)

    def step(
        self, keys: list[int], chunks: list[list[int]], sampling: list[RowParams] | None = None
    ) -> StepOutput:
        launched = self.launch(keys, chunks, sampling)
        if launched is not None:
            return launched.collect()
        if self.drafter is not None:
            self._before = {k: snapshot(self.table.caches[k]) for k in keys}  # type: ignore[arg-type]
        logits, hidden, routes = self.table.forward_hidden(keys, chunks, record=True)
        if self.drafter is not None:
            for key, h in zip(keys, hidden, strict=True):
                self.drafter.feed(key, self._before[key].length, h)
        # Left on the model's device: the recorded log-prob is computed there, where the
        # trainer recomputes it (exp/log differ in the last bit between CPU and GPU).
        last = torch.stack([rows[-1] for rows in logits]).float()
        return StepOutput(last, routes_to_cpu(routes), [rows.float() for rows in logits])

    def draft(self, keys: list[int], tokens: list[list[int]]) -> list[list[int]]:
        assert self.drafter is not None, "built with speculative_tokens > 0"
        return self.drafter.draft(keys, tokens)

    def truncate_cache(self, key: int, length: int) -> None:
        """Keep the first `length` rows of a cache stepped last (drop rejected drafts)."""
        assert self.drafter is not None, "built with speculative_tokens > 0"
        cache = self.table.caches[key]
        assert isinstance(cache, ModelCache), "rollback needs the reference caches"
        self.table.caches[key] = rollback(self._before[key], cache, length, self.model.cfg)
        self.drafter.truncate(key, length)

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
