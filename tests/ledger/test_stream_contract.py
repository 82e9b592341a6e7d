"""The rollout-stream contract, run unchanged against every backend.

The `backend` fixture is parametrised: the in-memory and SQLite runs are marked `unit`, the
Redis run `services` (real server at RLSYS_TEST_REDIS_URL, default 127.0.0.1:6379; skipped
with the reason if it does not answer, failed under RLSYS_REQUIRE_SERVICES=1). Each test
gets its own stream name, deleted afterwards.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from rlsys.ledger.stream import (
    MemoryStreamConfig,
    RedisStreamConfig,
    RolloutStream,
    SqliteStreamConfig,
    StreamError,
    entry_id_key,
    open_stream,
    resume_consumer,
)
from tests.conftest import REDIS_URL, require_service


def _host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 6379


MakeStream = Callable[..., RolloutStream]


@pytest.fixture(
    params=[
        pytest.param("memory", marks=pytest.mark.unit),
        pytest.param("sqlite", marks=pytest.mark.unit),
        pytest.param("redis", marks=pytest.mark.services),
    ]
)
def make_stream(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[MakeStream]:
    """Opens handles on one fresh stream: `make_stream(group=..., delete_acked=...)`."""
    name = f"rlsys:test:{uuid.uuid4().hex}"
    opened: list[RolloutStream] = []

    def make(group: str = "trainer", delete_acked: bool = True) -> RolloutStream:
        if request.param == "memory":
            config = MemoryStreamConfig(name=name, group=group, delete_acked=delete_acked)
        elif request.param == "sqlite":
            config = SqliteStreamConfig(
                path=str(tmp_path / "stream.db"),
                stream=name,
                group=group,
                delete_acked=delete_acked,
            )
        else:
            config = RedisStreamConfig(
                url=REDIS_URL, stream=name, group=group, delete_acked=delete_acked
            )
        if request.param == "redis":
            require_service("Redis", *_host_port(REDIS_URL))
        stream = open_stream(config)
        opened.append(stream)
        return stream

    yield make
    if opened:
        opened[0].delete()
    for stream in opened:
        stream.close()


def _publish(stream: RolloutStream, n: int, prefix: str = "r") -> list[str]:
    return stream.publish_many([(f"{prefix}{i}", {"i": i}) for i in range(n)])


def test_acked_entry_is_never_redelivered(make_stream: MakeStream) -> None:
    stream = make_stream()
    _publish(stream, 3)
    entries = stream.read("trainer-0", count=3)
    assert stream.ack([e.entry_id for e in entries]) == 3
    assert stream.reclaim("trainer-1", min_idle_ms=0) == []
    assert stream.read("trainer-1", count=10) == []
    assert stream.pending() == []


def test_unacked_entry_is_redelivered_by_reclaim(make_stream: MakeStream) -> None:
    stream = make_stream()
    _publish(stream, 2)
    first, second = stream.read("trainer-0", count=2)
    stream.ack([first.entry_id])
    [again] = stream.reclaim("trainer-1", min_idle_ms=0)
    assert (again.entry_id, again.rollout_id, again.payload) == (
        second.entry_id,
        second.rollout_id,
        second.payload,
    )
    assert (second.delivery_count, again.delivery_count) == (1, 2)
    assert [p.consumer for p in stream.pending()] == ["trainer-1"]


def test_reclaim_waits_for_min_idle(make_stream: MakeStream) -> None:
    stream = make_stream()
    _publish(stream, 1)
    stream.read("dead", count=1)
    assert stream.reclaim("live", min_idle_ms=60_000) == []
    time.sleep(0.06)
    assert [e.rollout_id for e in stream.reclaim("live", min_idle_ms=50)] == ["r0"]
    assert stream.reclaim("other", min_idle_ms=50) == []  # idle clock restarted on claim


def test_dead_consumers_entries_move_to_a_live_consumer(make_stream: MakeStream) -> None:
    stream = make_stream()
    _publish(stream, 5)
    dead = stream.read("trainer-dead", count=3)
    live = stream.read("trainer-live", count=2)
    stream.ack([e.entry_id for e in live])
    claimed = stream.reclaim("trainer-live", min_idle_ms=0, count=10)
    assert [e.entry_id for e in claimed] == [e.entry_id for e in dead]
    assert {p.consumer for p in stream.pending()} == {"trainer-live"}
    assert stream.pending(consumer="trainer-dead") == []
    assert stream.ack([e.entry_id for e in claimed]) == 3
    assert stream.position().pending == 0


def test_reclaim_takes_at_most_count(make_stream: MakeStream) -> None:
    stream = make_stream()
    _publish(stream, 7)
    stream.read("dead", count=7)
    time.sleep(0.06)
    # Claimed entries are idle again for 0 ms, so each call takes the next ones.
    batches = [stream.reclaim("live", min_idle_ms=50, count=3) for _ in range(4)]
    assert [len(b) for b in batches] == [3, 3, 1, 0]
    assert len({e.entry_id for b in batches for e in b}) == 7


def test_batched_publish_read_ack_keep_publish_order(make_stream: MakeStream) -> None:
    stream = make_stream()
    ids = _publish(stream, 250)
    assert sorted(ids, key=entry_id_key) == ids and len(set(ids)) == 250
    seen = []
    while batch := stream.read("trainer-0", count=64):
        assert len(batch) <= 64
        assert stream.ack([e.entry_id for e in batch]) == len(batch)
        seen.extend(batch)
    assert [e.entry_id for e in seen] == ids
    assert [e.rollout_id for e in seen] == [f"r{i}" for i in range(250)]
    assert [e.payload for e in seen] == [{"i": i} for i in range(250)]


def test_each_entry_goes_to_exactly_one_consumer(make_stream: MakeStream) -> None:
    stream = make_stream()
    ids = _publish(stream, 40)
    got: dict[str, list[str]] = {"a": [], "b": []}
    for turn in range(30):
        consumer = "ab"[turn % 2]
        got[consumer] += [e.entry_id for e in stream.read(consumer, count=3)]
    assert sorted(got["a"] + got["b"], key=entry_id_key) == ids
    assert not set(got["a"]) & set(got["b"])


def test_payloads_round_trip_as_json_or_bytes(make_stream: MakeStream) -> None:
    stream = make_stream()
    rollout = {"tokens": [1, 2, 3], "reward": 0.5, "done": True, "meta": None, "name": "é"}
    stream.publish_many([("json", rollout), ("raw", b"\x00\xff"), ("list", [1, "two"])])
    assert [e.payload for e in stream.read("t", count=3)] == [rollout, b"\x00\xff", [1, "two"]]


def test_unserialisable_payload_publishes_nothing(make_stream: MakeStream) -> None:
    stream = make_stream()
    with pytest.raises(TypeError):
        stream.publish_many([("ok", {"i": 1}), ("bad", {"x": object()})])
    assert stream.position().length == 0


def test_ack_ignores_entries_never_delivered(make_stream: MakeStream) -> None:
    stream = make_stream()
    first, second = _publish(stream, 2)
    stream.read("t", count=1)
    assert stream.ack([first, second]) == 1  # `second` was never delivered: kept, not deleted
    assert [e.entry_id for e in stream.read("t", count=1)] == [second]
    assert stream.ack([second]) == 1
    assert stream.ack([first, second]) == 0


def test_ack_of_an_id_no_stream_wrote_is_a_stream_error(make_stream: MakeStream) -> None:
    stream = make_stream()
    (entry_id,) = stream.publish_many([("r0", {"n": 0})])
    (entry,) = stream.read("c")
    with pytest.raises(StreamError):
        stream.ack(["not-an-id"])
    assert stream.ack([entry.entry_id]) == 1 and entry.entry_id == entry_id


def test_large_batches_round_trip_in_one_call_each(make_stream: MakeStream) -> None:
    stream = make_stream()
    ids = _publish(stream, 2500)
    entries = stream.read("t", count=5000)
    assert [e.entry_id for e in entries] == ids
    assert stream.ack(ids) == 2500
    assert stream.position().length == 0


def test_position_reports_pending_backlog_and_last_delivered(make_stream: MakeStream) -> None:
    stream = make_stream()
    assert stream.position().pending == 0 and stream.position().backlog == 0
    ids = _publish(stream, 6)
    batch = stream.read("t", count=4)
    stream.ack([batch[0].entry_id])
    position = stream.position()
    assert position.last_delivered_id == ids[3]
    assert (position.pending, position.backlog, position.length) == (3, 2, 5)


def test_delete_acked_false_keeps_acked_entries(make_stream: MakeStream) -> None:
    stream = make_stream(delete_acked=False)
    _publish(stream, 3)
    stream.ack([e.entry_id for e in stream.read("t", count=3)])
    assert stream.position().length == 3
    assert stream.read("t", count=3) == [] and stream.reclaim("u", 0) == []


def test_backlog_skips_entries_deleted_by_another_group(make_stream: MakeStream) -> None:
    trainer = make_stream(group="trainer")
    monitor = make_stream(group="monitor")  # acks and deletes before the trainer reads
    ids = _publish(trainer, 6)
    trainer.read("t", count=1)
    monitor.read("m", count=3)
    monitor.ack([ids[2]])  # a hole after the trainer's cursor: Redis no longer knows its lag
    assert trainer.position().backlog == 4
    assert [e.entry_id for e in trainer.read("t", count=10)] == [ids[1], *ids[3:]]


def test_handles_opened_later_share_stream_and_group(make_stream: MakeStream) -> None:
    producer = make_stream()
    _publish(producer, 3)
    consumer = make_stream()  # group created after the publish still sees every entry
    assert [e.rollout_id for e in consumer.read("t", count=2)] == ["r0", "r1"]
    assert [e.rollout_id for e in make_stream().read("u", count=5)] == ["r2"]


def test_blocking_read_wakes_up_on_publish(make_stream: MakeStream) -> None:
    consumer, producer = make_stream(), make_stream()
    started = time.monotonic()
    assert consumer.read("t", count=1, block_ms=50) == []
    assert time.monotonic() - started >= 0.04
    timer = threading.Timer(0.1, lambda: _publish(producer, 1))
    timer.start()
    started = time.monotonic()
    entries = consumer.read("t", count=1, block_ms=5_000)
    timer.join()
    assert [e.rollout_id for e in entries] == ["r0"]
    assert time.monotonic() - started < 2.0


def test_resume_neither_skips_nor_repeats(make_stream: MakeStream) -> None:
    stream = make_stream()
    ids = _publish(stream, 10)
    # Trainer run 1: reads 6, commits a step on the first 4, crashes before acking them.
    batch = stream.read("trainer-run1", count=6)
    checkpoint = {"committed": [e.entry_id for e in batch[:4]], "pos": stream.position()}
    assert checkpoint["pos"].last_delivered_id == ids[5]

    resumed = make_stream()
    redo = resume_consumer(resumed, "trainer-run2", checkpoint["committed"])
    rest = resumed.read("trainer-run2", count=100)
    resumed.ack([e.entry_id for e in redo + rest])
    consumed = checkpoint["committed"] + [e.entry_id for e in redo + rest]
    assert consumed == ids  # every entry once: none skipped, none repeated
    assert [e.delivery_count for e in redo] == [2, 2]
    assert resumed.position().pending == 0
    assert resume_consumer(resumed, "trainer-run3", checkpoint["committed"]) == []


def test_a_retried_publish_adds_no_second_entry(make_stream: MakeStream) -> None:
    stream = make_stream()
    first = stream.publish_many([("r0", {"i": 0}), ("r1", {"i": 1})])
    again = stream.publish_many([("r1", {"i": 1}), ("r2", {"i": 2})])  # r1's reply was lost
    assert again[0] == first[1]
    delivered = stream.read("c", count=10)
    assert [e.rollout_id for e in delivered] == ["r0", "r1", "r2"]
    assert stream.publish("r0", {"i": 0}) == first[0]  # pending: still the same entry
    assert stream.read("c", count=10) == []
    stream.ack([e.entry_id for e in delivered])
    assert stream.position().length == 0
