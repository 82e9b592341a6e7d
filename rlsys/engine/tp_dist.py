"""TP over real torch.distributed ranks: one process per rank, gloo (CPU) or NCCL (GPU).

The driver (the engine's scheduler) sends every rank the same command over a pipe; the
ranks run their shard (`rlsys.engine.tp_shard`) and all-gather row-parallel subtotals with
`dist.all_gather`, summing them in the fixed tree order (never `all_reduce`, whose order is
the backend's). Rank 0 returns the logits and routes; every rank acknowledges each command
so an error on any rank surfaces in the driver.
- gloo: ranks on the CPU, reference kernels.
- nccl: rank r on `cuda:r` (the GPUs Ray gave the replica), the Triton kernels over a
  per-rank paged KV pool; the last-row logits come back to the driver's GPU (`cuda:0`) as
  an exact copy, so the sampler computes the recorded log-prob on a GPU, as the trainer.
  New weights that arrive on a GPU (the trainer's NCCL broadcast lands on `cuda:0`) go to
  the ranks as CUDA IPC handles, never through the host: each rank copies only its own
  shard, GPU to GPU. The driver holds the received tensors until every rank has loaded.
Every degree gives bitwise the TP=1 logits: whole KV groups per rank, column slices of a
product equal the full product's columns, and the fixed 8-chunk tree (`rlsys.kernels.tp`).
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

from rlsys.config.model import ModelConfig
from rlsys.engine.runner import CacheTable, StepOutput, attach_pool, routes_to_cpu
from rlsys.engine.tp_shard import build_shard, load_shard
from rlsys.model import Transformer


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _gather(tensor: Tensor) -> list[Tensor]:
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(out, tensor)
    return out


def _all_reduce_as_gather(tensor: Tensor) -> list[Tensor]:
    """Benchmark only: NCCL's own all-reduce (its order, not TP-invariant), shaped as a
    gather whose fixed-tree sum is that value (x + 0 + ... = x exactly)."""
    total = tensor.clone()
    dist.all_reduce(total)
    return [total] + [torch.zeros_like(tensor) for _ in range(dist.get_world_size() - 1)]


REDUCERS = {"tree": _gather, "allreduce": _all_reduce_as_gather}


class _Rank:
    """One worker process's shard and caches; `handle` runs one driver command."""

    def __init__(
        self,
        rank: int,
        degree: int,
        cfg: ModelConfig,
        device: torch.device,
        kv_pages: int,
        reduce: str,
    ) -> None:
        self.rank, self.degree, self.cfg, self.device = rank, degree, cfg, device
        self.kv_pages, self.reduce = kv_pages, reduce
        self.table: CacheTable | None = None

    def handle(self, op: str, args: Any) -> Any:
        if op == "load":
            if self.table is None:
                shard = build_shard(self.cfg, args, self.degree, self.rank, REDUCERS[self.reduce])
                shard = shard.to(self.device)
                attach_pool(shard, self.device, self.kv_pages)
                self.table = CacheTable(shard, self.device)
            else:
                load_shard(self.table.model, self.cfg, args)
            return None
        table = self.table
        assert table is not None, "weights are loaded first"
        if op == "new":
            return table.new()
        if op == "fork":
            return table.fork(args)
        if op == "free":
            return table.free(args)
        if op == "step":
            keys, chunks = args
            logits, routes = table.forward(keys, chunks, record=self.rank == 0)
            if self.rank:
                return None
            return torch.stack([rows[-1] for rows in logits]).float().cpu(), routes_to_cpu(routes)
        raise ValueError(f"unknown op {op!r}")


def _worker(
    rank: int, degree: int, port: int, cfg_data: dict[str, Any], conn: Any, backend: str,
    kv_pages: int, reduce: str,
) -> None:  # fmt: skip
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=degree,
        timeout=timedelta(seconds=120),
        device_id=device if backend == "nccl" else None,
    )
    me = _Rank(rank, degree, ModelConfig.model_validate(cfg_data), device, kv_pages, reduce)
    try:
        while True:
            op, args = conn.recv()
            if op == "close":
                conn.send(("ok", None))
                return
            try:
                conn.send(("ok", me.handle(op, args)))
            except Exception as err:  # reported to the driver, which raises it
                conn.send(("error", f"rank {rank}: {err!r}"))
    finally:
        dist.destroy_process_group()


class DistTPRunner:
    """A `ModelRunner` over `degree` torch.distributed processes (`backend` gloo or nccl)."""

    def __init__(
        self,
        cfg: ModelConfig,
        state: Mapping[str, Tensor] | None,
        degree: int,
        backend: str = "gloo",
        kv_pages: int = 0,
        reduce: str = "tree",
    ) -> None:
        """`reduce="allreduce"` swaps the fixed tree for NCCL's all-reduce (benchmarks only:
        it gives up TP invariance)."""
        if backend == "nccl" and torch.cuda.device_count() < degree:
            raise ValueError(
                f"tp={degree} over NCCL needs {degree} GPUs; this process sees "
                f"{torch.cuda.device_count()}"
            )
        # forkserver with torch + this module preloaded: ranks start by fork of one warm
        # process (no threads forked, no CUDA context), instead of each importing torch
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "rlsys.engine.tp_dist"])
        self.device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
        port = _free_port()
        self.conns, self.procs = [], []
        for rank in range(degree):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker,
                args=(rank, degree, port, cfg.model_dump(), child, backend, kv_pages, reduce),
                daemon=True,
            )
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        full = state if state is not None else Transformer(cfg).state_dict()
        self._all("load", {k: v.detach().cpu() for k, v in full.items()})

    def _all(self, op: str, args: Any = None) -> list[Any]:
        for conn in self.conns:
            conn.send((op, args))
        replies = [conn.recv() for conn in self.conns]
        errors = [value for status, value in replies if status == "error"]
        if errors:
            raise RuntimeError("; ".join(errors))
        return [value for _, value in replies]

    def new_cache(self) -> int:
        return _same(self._all("new"))

    def fork_cache(self, key: int) -> int:
        return _same(self._all("fork", key))

    def free_cache(self, key: int) -> None:
        self._all("free", key)

    def step(self, keys: list[int], chunks: list[list[int]], sampling: object = None) -> StepOutput:
        del sampling  # the core samples (only `LocalRunner`'s decode graphs draw themselves)
        last, routes = self._all("step", (keys, chunks))[0]
        return StepOutput(last.to(self.device), routes)

    def load_state_dict(self, state: Mapping[str, Tensor]) -> None:
        self._all("load", {k: self._shippable(v) for k, v in state.items()})

    def _shippable(self, tensor: Tensor) -> Tensor:
        """A CUDA tensor crosses the pipe as an IPC handle (rank r reads its slice from the
        driver's GPU over P2P); anything else as host memory."""
        if tensor.is_cuda and self.device.type == "cuda":
            return tensor.detach()
        return tensor.detach().cpu()

    def close(self) -> None:
        if not self.procs:
            return
        try:
            self._all("close")
        finally:
            for proc in self.procs:
                proc.join(timeout=10)
                if proc.is_alive():
                    proc.kill()
            self.procs = []


def _same(keys: list[int]) -> int:
    assert len(set(keys)) == 1, f"rank cache tables diverged: {keys}"
    return keys[0]
