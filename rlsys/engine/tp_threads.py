"""TP in one process: each rank's shard runs in its own thread, gathers go through memory.

Explicit shards (separate weights and caches per rank, `rlsys.engine.tp_shard`), the same
fixed-tree reductions as the gloo backend; useful for tests, `rlsys align` and machines
where spawning processes is unwelcome. Ranks run concurrently (torch releases the GIL), a
barrier orders each all-gather. Invariant: every rank receives the same chunks in the same
order, so their cache keys and their logits agree; rank 0 answers.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import Tensor

from rlsys.config.model import ModelConfig
from rlsys.engine.runner import CacheTable, StepOutput, routes_to_cpu
from rlsys.engine.tp_shard import build_shard, load_shard
from rlsys.model import Transformer


class ThreadExchange:
    """All-gather between `n` threads: slot per rank, two barrier phases (write, read)."""

    def __init__(self, n: int, timeout_s: float = 120.0) -> None:
        self.barrier = threading.Barrier(n, timeout=timeout_s)
        self.slots: list[Tensor | None] = [None] * n

    def all_gather(self, rank: int, tensor: Tensor) -> list[Tensor]:
        self.slots[rank] = tensor
        self.barrier.wait()
        out = [t for t in self.slots if t is not None]
        self.barrier.wait()  # nobody overwrites a slot before every rank has read it
        return out


class ThreadedTPRunner:
    """A `ModelRunner` over `degree` shard threads."""

    def __init__(self, cfg: ModelConfig, state: Mapping[str, Tensor] | None, degree: int) -> None:
        self.cfg, self.degree = cfg, degree
        full = state if state is not None else Transformer(cfg).state_dict()
        self.exchange = ThreadExchange(degree)
        self.shards = [
            build_shard(cfg, full, degree, r, lambda t, r=r: self.exchange.all_gather(r, t))
            for r in range(degree)
        ]
        cpu = torch.device("cpu")
        self.tables = [CacheTable(shard, cpu) for shard in self.shards]
        self.pool = ThreadPoolExecutor(degree, thread_name_prefix="rlsys-tp")

    def new_cache(self) -> int:
        return _same([t.new() for t in self.tables])

    def fork_cache(self, key: int) -> int:
        return _same([t.fork(key) for t in self.tables])

    def free_cache(self, key: int) -> None:
        for table in self.tables:
            table.free(key)

    def step(self, keys: list[int], chunks: list[list[int]], sampling: object = None) -> StepOutput:
        del sampling  # the core samples (only `LocalRunner`'s decode graphs draw themselves)
        futures = [self.pool.submit(self._rank_step, r, keys, chunks) for r in range(self.degree)]
        outs, errors = [], []
        for future in futures:
            try:
                outs.append(future.result())
            except Exception as err:
                errors.append(err)
        if errors:
            self.exchange.barrier.reset()
            raise errors[0]
        logits, routes = outs[0]
        last = torch.stack([rows[-1] for rows in logits]).float()
        return StepOutput(last, routes_to_cpu(routes))

    def _rank_step(self, rank: int, keys: list[int], chunks: list[list[int]]):  # type: ignore[no-untyped-def]
        try:
            return self.tables[rank].forward(keys, chunks, record=rank == 0)
        except Exception:
            self.exchange.barrier.abort()  # release the ranks waiting on this one
            raise

    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        for shard in self.shards:
            load_shard(shard, self.cfg, state)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        for table in self.tables:
            table.caches.clear()


def _same(keys: list[int]) -> int:
    assert len(set(keys)) == 1, f"shard cache tables diverged: {keys}"
    return keys[0]
