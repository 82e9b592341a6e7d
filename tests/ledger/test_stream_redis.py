"""Redis rollout stream against the real server: dead consumer processes and bad URLs.

The behaviour shared with the in-memory backend lives in test_stream_contract.py. The server
is RLSYS_TEST_REDIS_URL (default 127.0.0.1:6379); tests skip, saying so, if it is silent
(fail under RLSYS_REQUIRE_SERVICES=1).
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

from rlsys.ledger.redis_stream import RedisRolloutStream, redact_url
from rlsys.ledger.stream import (
    RedisStreamConfig,
    RolloutStream,
    StreamConnectionError,
    open_stream,
)
from tests.conftest import REDIS_URL, require_service

pytestmark = pytest.mark.services


# A worker that takes three entries and dies without acknowledging them.
DEAD_WORKER = """
import sys
from rlsys.ledger.stream import RedisStreamConfig, open_stream
stream = open_stream(RedisStreamConfig(url=sys.argv[1], stream=sys.argv[2]))
print(" ".join(e.entry_id for e in stream.read("worker-dead", count=3)))
"""


@pytest.fixture
def config() -> Iterator[RedisStreamConfig]:
    config = RedisStreamConfig(url=REDIS_URL, stream=f"rlsys:test:{uuid.uuid4().hex}")
    parts = urlsplit(REDIS_URL)
    require_service("Redis", parts.hostname or "127.0.0.1", parts.port or 6379)
    stream = open_stream(config)
    yield config
    stream.delete()
    stream.close()


def test_entries_pending_on_an_exited_process_are_reclaimed(config: RedisStreamConfig) -> None:
    stream = open_stream(config)
    ids = stream.publish_many([(f"r{i}", {"i": i}) for i in range(5)])
    worker = subprocess.run(
        [sys.executable, "-c", DEAD_WORKER, config.url, config.stream],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert worker.stdout.split() == ids[:3]
    assert [p.consumer for p in stream.pending()] == ["worker-dead"] * 3

    time.sleep(0.06)
    claimed = stream.reclaim("trainer-live", min_idle_ms=50, count=10)
    assert [(e.entry_id, e.delivery_count) for e in claimed] == [(i, 2) for i in ids[:3]]
    rest = stream.read("trainer-live", count=10)
    assert [e.entry_id for e in rest] == ids[3:]
    assert stream.ack([e.entry_id for e in claimed + rest]) == 5
    position = stream.position()
    assert (position.pending, position.backlog, position.length) == (0, 0, 0)


def test_length_counts_what_is_in_flight_and_the_server_reports_its_memory(
    config: RedisStreamConfig,
) -> None:
    stream = RedisRolloutStream(config)
    stream.publish_many([(f"r{i}", {"i": i}) for i in range(4)])
    assert stream.length() == 4
    taken = stream.read("t", count=3)
    stream.ack([e.entry_id for e in taken])  # acked entries are deleted
    assert stream.length() == 1
    assert stream.server_memory_bytes() > 0
    stream.close()


def test_open_stream_from_url_reaches_the_same_stream(config: RedisStreamConfig) -> None:
    by_config = open_stream(config)
    by_url = open_stream(f"{config.url}?stream={config.stream}&group={config.group}")
    assert isinstance(by_url, RedisRolloutStream) and isinstance(by_url, RolloutStream)
    [entry_id] = by_config.publish_many([("r0", b"raw")])
    assert [e.entry_id for e in by_url.read("t", count=1)] == [entry_id]
    by_url.close()


def test_unreachable_redis_error_names_the_url_without_password() -> None:
    url = "redis://:hunter2@127.0.0.1:1/0?stream=rlsys:nowhere"
    with pytest.raises(StreamConnectionError) as info:
        open_stream(url)
    message = str(info.value)
    assert "redis://:***@127.0.0.1:1/0" in message and "rlsys:nowhere" in message
    assert "hunter2" not in message


def test_malformed_redis_url_is_a_value_error_naming_it() -> None:
    with pytest.raises(ValueError, match="127.0.0.1:port"):
        open_stream("redis://127.0.0.1:port/0?stream=x")


def test_redact_url_hides_only_the_password() -> None:
    assert redact_url("redis://user:pw@h:6379/1") == "redis://user:***@h:6379/1"
    assert redact_url("redis://h:6379/1") == "redis://h:6379/1"
