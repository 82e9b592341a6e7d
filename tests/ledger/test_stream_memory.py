"""In-memory rollout stream: thread safety, name sharing, and opening streams from URLs.

The behaviour shared with Redis lives in test_stream_contract.py (run on both backends).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter

import pytest

from rlsys.ledger.memory_stream import MemoryRolloutStream
from rlsys.ledger.redis_stream import RedisRolloutStream
from rlsys.ledger.sqlite_stream import SqliteRolloutStream
from rlsys.ledger.stream import (
    MemoryStreamConfig,
    RedisStreamConfig,
    RolloutStream,
    SqliteStreamConfig,
    StreamError,
    open_stream,
    parse_stream_url,
    stream_backends,
)

pytestmark = pytest.mark.unit


@pytest.fixture
def stream_name() -> str:
    return f"test-{uuid.uuid4().hex}"


def test_concurrent_producers_and_consumers_see_each_entry_once(stream_name: str) -> None:
    stream = open_stream(f"memory://{stream_name}")
    producers, per_producer = 4, 500
    consumed: Counter[str] = Counter()
    lock = threading.Lock()
    done = threading.Event()

    def produce(p: int) -> None:
        for start in range(0, per_producer, 50):
            stream.publish_many([(f"p{p}-{i}", i) for i in range(start, start + 50)])

    def consume(name: str) -> None:
        handle = open_stream(f"memory://{stream_name}")
        while not done.is_set() or handle.position().backlog:
            batch = handle.read(name, count=32, block_ms=10)
            with lock:
                consumed.update(e.rollout_id for e in batch)
            handle.ack([e.entry_id for e in batch])

    threads = [threading.Thread(target=produce, args=(p,)) for p in range(producers)]
    consumers = [threading.Thread(target=consume, args=(f"c{c}",)) for c in range(3)]
    for thread in threads + consumers:
        thread.start()
    for thread in threads:
        thread.join()
    done.set()
    for thread in consumers:
        thread.join()
    expected = {f"p{p}-{i}" for p in range(producers) for i in range(per_producer)}
    assert set(consumed) == expected and set(consumed.values()) == {1}
    assert stream.position().length == 0  # delete_acked keeps the log bounded
    stream.delete()


IDLE_MS = 1500


def test_concurrent_reclaimers_never_claim_the_same_entry(stream_name: str) -> None:
    stream = open_stream(f"memory://{stream_name}")
    stream.publish_many([(f"r{i}", i) for i in range(2000)])
    while stream.read("dead", count=500):
        pass
    time.sleep(IDLE_MS / 1000 + 0.05)  # every entry idle past the bound
    claims: dict[str, list[str]] = {}

    def reclaim(name: str) -> None:
        # A claim restarts the idle clock, so what one reclaimer took is not idle for IDLE_MS:
        # the bound is long beside a 2,000-entry claim even on a loaded box (at 50 ms, a
        # claim slower than that let the next reclaimer take everything again).
        claims[name] = [e.entry_id for e in stream.reclaim(name, min_idle_ms=IDLE_MS, count=2000)]

    threads = [threading.Thread(target=reclaim, args=(f"c{i}",)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    claimed = Counter(entry_id for ids in claims.values() for entry_id in ids)
    assert len(claimed) == 2000 and set(claimed.values()) == {1}
    assert {p.consumer for p in stream.pending(count=5000)} <= set(claims)
    stream.delete()


def test_streams_with_different_names_are_independent(stream_name: str) -> None:
    first = open_stream(f"memory://{stream_name}-a")
    second = open_stream(f"memory://{stream_name}-b")
    first.publish("r0", 0)
    assert second.read("t", count=5) == []
    assert [e.rollout_id for e in first.read("t", count=5)] == ["r0"]
    first.delete()
    second.delete()


def test_deleted_stream_reports_its_missing_group(stream_name: str) -> None:
    stream = open_stream(f"memory://{stream_name}")
    stream.delete()
    with pytest.raises(StreamError, match=stream_name):
        stream.read("t")
    assert open_stream(f"memory://{stream_name}").position().length == 0


def test_registry_maps_every_backend_name_to_its_class(stream_name: str) -> None:
    assert stream_backends() == {
        "memory": MemoryRolloutStream,
        "redis": RedisRolloutStream,
        "sqlite": SqliteRolloutStream,
    }
    stream = open_stream(MemoryStreamConfig(name=stream_name))
    assert isinstance(stream, MemoryRolloutStream) and isinstance(stream, RolloutStream)
    stream.delete()


def test_memory_url_names_the_stream_and_group() -> None:
    assert parse_stream_url("memory://job7?group=eval") == MemoryStreamConfig(
        name="job7", group="eval"
    )
    assert parse_stream_url("memory://") == MemoryStreamConfig()


def test_sqlite_url_names_the_file_and_stream() -> None:
    assert parse_stream_url("sqlite:///tmp/run/stream.db?stream=job7") == SqliteStreamConfig(
        path="/tmp/run/stream.db", stream="job7"
    )


def test_redis_url_keeps_connection_options_and_takes_stream_options() -> None:
    config = parse_stream_url(
        "redis://:pw@10.0.0.5:6380/2?stream=rlsys:job7&group=t&delete_acked=false"
        "&health_check_interval=5"
    )
    assert config == RedisStreamConfig(
        url="redis://:pw@10.0.0.5:6380/2?health_check_interval=5",
        stream="rlsys:job7",
        group="t",
        delete_acked=False,
    )


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("kafka://broker/topic", "unknown scheme 'kafka'"),
        ("memory://x?grop=t", "grop"),
        ("redis://h:6379/0?group=", "group"),
        ("redis://h/0?socket_timeout_s=-1", "socket_timeout_s"),
    ],
)
def test_bad_stream_url_names_url_and_problem(url: str, problem: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_stream_url(url)
    assert url in str(info.value) and problem in str(info.value)
