"""Rollout-stream throughput: entries/s published, and consumed with acknowledgement, batched.

For each backend and batch size, on a fresh stream:
- publish:      `publish_many` of N entries, `batch` per call;
- consume+ack:  `read(count=batch)` then `ack` of that batch, until the stream is drained;
- sequential:   N / (publish time + consume time), one thread doing both;
- concurrent:   one producer and one consumer running at once (Redis: two processes; memory:
                two threads of one process, which share the GIL), N / wall time until the
                consumer has acked the last entry.
Payloads are JSON objects of about `--payload-bytes` bytes (a rollout summary, not its tokens).

    .venv/bin/python benchmarks/bench_stream.py --entries 200000 --batch 100,1000
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from rlsys.ledger.stream import (
    MemoryStreamConfig,
    RedisStreamConfig,
    RolloutStream,
    open_stream,
)

StreamConfig = MemoryStreamConfig | RedisStreamConfig


@dataclass
class Row:
    backend: str
    batch: int
    publish: float
    consume_ack: float
    sequential: float
    concurrent: float


def _config(backend: str, redis_url: str) -> StreamConfig:
    name = f"rlsys:bench:{uuid.uuid4().hex}"
    if backend == "memory":
        return MemoryStreamConfig(name=name)
    return RedisStreamConfig(url=redis_url, stream=name)


def _items(start: int, count: int, payload_bytes: int) -> list[tuple[str, dict]]:
    pad = "x" * max(0, payload_bytes - 60)
    return [
        (f"rollout-{i}", {"group": i // 8, "reward": 1.0, "pad": pad})
        for i in range(start, start + count)
    ]


def produce(
    config: StreamConfig, entries: int, batch: int, payload_bytes: int, ready: Any = None
) -> None:
    stream = open_stream(config)
    if ready is not None:
        ready.wait()
    for start in range(0, entries, batch):
        stream.publish_many(_items(start, min(batch, entries - start), payload_bytes))


def consume(config: StreamConfig, entries: int, batch: int, ready: Any = None) -> int:
    """Reads and acks until `entries` were acked; returns how many (blocks while empty)."""
    stream = open_stream(config)
    if ready is not None:
        ready.wait()
    acked = 0
    while acked < entries:
        got = stream.read("bench-consumer", count=batch, block_ms=1000)
        acked += stream.ack([e.entry_id for e in got])
    return acked


def _drain(stream: RolloutStream, batch: int) -> int:
    acked = 0
    while got := stream.read("bench-consumer", count=batch):
        acked += stream.ack([e.entry_id for e in got])
    return acked


def _sequential(config: StreamConfig, entries: int, batch: int, payload_bytes: int) -> tuple:
    stream = open_stream(config)
    started = time.perf_counter()
    produce(config, entries, batch, payload_bytes)
    published = time.perf_counter()
    assert _drain(stream, batch) == entries
    consumed = time.perf_counter()
    stream.delete()
    return published - started, consumed - published


def _concurrent(backend: str, config: StreamConfig, entries: int, batch: int, pb: int) -> float:
    stream = open_stream(config)  # creates the group before either side starts
    # Both sides wait on `ready` after connecting: the clock excludes process start-up.
    if backend == "memory":
        ready: Any = threading.Barrier(3)
        workers: list[Any] = [
            threading.Thread(target=produce, args=(config, entries, batch, pb, ready)),
            threading.Thread(target=consume, args=(config, entries, batch, ready)),
        ]
    else:
        ctx = mp.get_context("spawn")
        ready = ctx.Barrier(3)
        workers = [
            ctx.Process(target=produce, args=(config, entries, batch, pb, ready)),
            ctx.Process(target=consume, args=(config, entries, batch, ready)),
        ]
    for worker in workers:
        worker.start()
    ready.wait()
    started = time.perf_counter()
    for worker in workers:
        worker.join()
    elapsed = time.perf_counter() - started
    assert stream.position().pending == 0 and stream.position().length == 0
    stream.delete()
    return elapsed


def measure(backend: str, batch: int, args: argparse.Namespace) -> Row:
    n = args.entries
    publish_s, consume_s = _sequential(_config(backend, args.redis_url), n, batch, args.payload)
    concurrent_s = _concurrent(backend, _config(backend, args.redis_url), n, batch, args.payload)
    return Row(
        backend, batch, n / publish_s, n / consume_s, n / (publish_s + consume_s), n / concurrent_s
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="memory,redis")
    parser.add_argument("--entries", type=int, default=200_000)
    parser.add_argument("--batch", default="100,1000", help="comma-separated batch sizes")
    parser.add_argument("--payload", type=int, default=256, help="payload size in bytes")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    args = parser.parse_args()
    print(f"entries={args.entries}  payload~{args.payload} B JSON  (entries/s)")
    header = ("backend", "batch", "publish", "consume+ack", "sequential", "concurrent")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for backend in args.backends.split(","):
        for batch in map(int, args.batch.split(",")):
            row = measure(backend, batch, args)
            rates = (row.publish, row.consume_ack, row.sequential, row.concurrent)
            print(
                f"| {row.backend} | {row.batch} | " + " | ".join(f"{r:,.0f}" for r in rates) + " |"
            )


if __name__ == "__main__":
    main()
