"""Redis Streams backend of the rollout stream: durable, and safe against dead consumers.

Mapping onto Redis (7.0 or newer, for XAUTOCLAIM's deleted-id reply and XINFO's lag):
publish = one XADD per entry, a whole batch inside one Lua script (one round trip, and
atomic: a dropped connection never leaves half a batch published); the group is created on open with
XGROUP CREATE ... 0 MKSTREAM (BUSYGROUP ignored), so entries published before the trainer
first reads are still delivered; read = XREADGROUP ">"; ack = XACK (and, with
`delete_acked`, XDEL of exactly the entries this call acked, in one Lua script so an entry
that was never delivered can never be deleted); reclaim = XAUTOCLAIM; introspection =
XPENDING and XINFO GROUPS.

An entry is one field-value pair, `rollout_id -> kind byte + payload` (kind `j` JSON, `b`
bytes): the fewest RESP items per entry, which is what redis-py's pure-Python parser and
packer spend their time on. Publishing is idempotent per rollout id (see `_PUBLISH`): a
batch redis-py or a worker re-sends after a dropped connection adds no second entry.
Every Redis failure surfaces as `StreamConnectionError` (naming the URL, password hidden)
or `StreamError` (naming the stream), never as a bare redis-py exception.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from urllib.parse import urlsplit, urlunsplit

import redis

from rlsys.ledger.stream import (
    STREAM_BACKENDS,
    Payload,
    PendingEntry,
    RedisStreamConfig,
    StreamConnectionError,
    StreamEntry,
    StreamError,
    StreamPosition,
    decode_payload,
    encode_payload,
)

# Idempotent per rollout id: KEYS[1]..':pub:'..rollout_id remembers the entry a rollout was
# published as (for a day); a retried publish whose entry is still in the stream gets that
# id back instead of a second entry.
_PUBLISH = """
local ids = {}
local ttl = tonumber(ARGV[1])
for i = 2, #ARGV, 2 do
  local key = KEYS[1] .. ':pub:' .. ARGV[i]
  local id = redis.call('GET', key)
  if not id or #redis.call('XRANGE', KEYS[1], id, id) == 0 then
    id = redis.call('XADD', KEYS[1], '*', ARGV[i], ARGV[i + 1])
    redis.call('SET', key, id, 'EX', ttl)
  end
  ids[#ids + 1] = id
end
return ids
"""
_PUBLISHED_TTL_S = 86_400

# XACK one id at a time tells which entries were pending; only those are deleted, in bulk
# (chunks stay under Lua's unpack limit).
_ACK_AND_DELETE = """
local acked = {}
for i = 2, #ARGV do
  if redis.call('XACK', KEYS[1], ARGV[1], ARGV[i]) == 1 then
    acked[#acked + 1] = ARGV[i]
  end
end
for i = 1, #acked, 1000 do
  redis.call('XDEL', KEYS[1], unpack(acked, i, math.min(i + 999, #acked)))
end
return #acked
"""


def redact_url(url: str) -> str:
    """The URL with its password replaced by `***`, fit for error messages and logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class RedisRolloutStream:
    """A `RolloutStream` on a Redis Stream key, read through one consumer group."""

    def __init__(self, config: RedisStreamConfig) -> None:
        self.config = config
        self.name = config.stream
        self.group = config.group
        self.url = redact_url(config.url)
        try:
            # protocol=2 pins the reply shapes parsed below, whatever redis-py's default.
            self._redis = redis.Redis.from_url(
                config.url,
                protocol=2,
                socket_timeout=config.socket_timeout_s,
                socket_connect_timeout=min(config.socket_timeout_s, 5.0),
            )
        except ValueError as exc:
            raise ValueError(f"Redis stream URL {self.url!r} is malformed: {exc}") from exc
        self._publish = self._redis.register_script(_PUBLISH)
        self._ack_and_delete = self._redis.register_script(_ACK_AND_DELETE)
        with self._errors("create consumer group"):
            try:
                self._redis.xgroup_create(self.name, self.group, id="0", mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    @contextmanager
    def _errors(self, what: str) -> Iterator[None]:
        try:
            yield
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise StreamConnectionError(
                f"Redis at {self.url} did not answer ({what} on stream {self.name!r}): {exc}"
            ) from exc
        except redis.RedisError as exc:
            raise StreamError(
                f"Redis stream {self.name!r} (group {self.group!r}) at {self.url}: "
                f"{what} failed: {exc}"
            ) from exc

    def publish(self, rollout_id: str, payload: Payload) -> str:
        return self.publish_many([(rollout_id, payload)])[0]

    def publish_many(self, items: Sequence[tuple[str, Payload]]) -> list[str]:
        args: list[str | bytes | int] = [_PUBLISHED_TTL_S]
        for rollout_id, payload in items:
            kind, data = encode_payload(payload)
            args += (rollout_id, kind + data)
        if len(args) == 1:
            return []
        with self._errors("publish"):
            return [_text(entry_id) for entry_id in self._publish(keys=[self.name], args=args)]

    def read(self, consumer: str, count: int = 1, block_ms: int | None = None) -> list[StreamEntry]:
        # BLOCK 0 means "forever" to Redis; here 0 means "do not wait".
        block = block_ms if block_ms else None
        if block is not None and block >= self.config.socket_timeout_s * 1000:
            raise ValueError(
                f"read(block_ms={block_ms}) must be shorter than the socket timeout "
                f"({self.config.socket_timeout_s} s) of stream {self.name!r}"
            )
        with self._errors("read"):
            reply = self._redis.xreadgroup(
                self.group, consumer, {self.name: ">"}, count=count, block=block
            )
        if not reply:
            return []
        return [self._entry(entry_id, fields, 1) for entry_id, fields in reply[0][1]]

    def ack(self, entry_ids: Sequence[str]) -> int:
        if not entry_ids:
            return 0
        with self._errors("ack"):
            if self.config.delete_acked:
                return int(self._ack_and_delete(keys=[self.name], args=[self.group, *entry_ids]))
            return int(self._redis.xack(self.name, self.group, *entry_ids))

    def reclaim(self, consumer: str, min_idle_ms: int, count: int = 100) -> list[StreamEntry]:
        claimed: list[tuple[bytes, dict[bytes, bytes]]] = []
        start = "0-0"
        with self._errors("reclaim"):
            # XAUTOCLAIM scans a bounded slice of the pending list per call: follow its cursor.
            while len(claimed) < count:
                cursor, entries, _deleted = self._redis.xautoclaim(
                    self.name, self.group, consumer, min_idle_ms, start, count=count - len(claimed)
                )
                claimed.extend(entries)
                start = _text(cursor)
                if start == "0-0":
                    break
            counts = self._delivery_counts([_text(entry_id) for entry_id, _ in claimed])
        return [
            self._entry(entry_id, fields, counts[_text(entry_id)]) for entry_id, fields in claimed
        ]

    def _delivery_counts(self, entry_ids: list[str]) -> dict[str, int]:
        """XAUTOCLAIM does not report delivery counts; one pipelined XPENDING per entry does."""
        pipe = self._redis.pipeline(transaction=False)
        for entry_id in entry_ids:
            pipe.xpending_range(self.name, self.group, entry_id, entry_id, 1)
        counts = {}
        for entry_id, rows in zip(entry_ids, pipe.execute(), strict=True):
            counts[entry_id] = int(rows[0]["times_delivered"]) if rows else 1
        return counts

    def pending(self, consumer: str | None = None, count: int = 1000) -> list[PendingEntry]:
        with self._errors("pending"):
            rows = self._redis.xpending_range(
                self.name, self.group, "-", "+", count, consumername=consumer
            )
        return [
            PendingEntry(
                entry_id=_text(row["message_id"]),
                consumer=_text(row["consumer"]),
                idle_ms=int(row["time_since_delivered"]),
                delivery_count=int(row["times_delivered"]),
            )
            for row in rows
        ]

    def position(self) -> StreamPosition:
        with self._errors("position"):
            pipe = self._redis.pipeline(transaction=True)
            pipe.xinfo_groups(self.name)
            pipe.xlen(self.name)
            groups, length = pipe.execute()
            info = next((g for g in groups if _text(g["name"]) == self.group), None)
            if info is None:
                raise StreamError(f"Redis stream {self.name!r} has no group {self.group!r}")
            last_delivered = _text(info["last-delivered-id"])
            lag = info.get("lag")
            # Redis leaves lag unknown when entries after the group's cursor were deleted.
            backlog = int(lag) if lag is not None else self._count_after(last_delivered)
        return StreamPosition(last_delivered, int(info["pending"]), backlog, int(length))

    def _count_after(self, entry_id: str) -> int:
        total, start = 0, f"({entry_id}"
        while page := self._redis.xrange(self.name, min=start, count=10_000):
            total += len(page)
            start = f"({_text(page[-1][0])}"
        return total

    def length(self) -> int:
        """Entries in the stream now (acked entries are deleted: what is in flight)."""
        with self._errors("length"):
            return int(self._redis.xlen(self.name))

    def server_memory_bytes(self) -> int:
        """The Redis server's `used_memory` (all keys, not this stream's alone)."""
        with self._errors("memory"):
            return int(self._redis.info("memory")["used_memory"])

    def delete(self) -> None:
        with self._errors("delete"):
            self._redis.delete(self.name)
            for key in self._redis.scan_iter(match=f"{self.name}:pub:*", count=1000):
                self._redis.delete(key)

    def close(self) -> None:
        self._redis.close()

    @staticmethod
    def _entry(entry_id: bytes, fields: dict[bytes, bytes], delivery_count: int) -> StreamEntry:
        ((rollout_id, value),) = fields.items()
        payload = decode_payload(value[:1], value[1:])
        return StreamEntry(_text(entry_id), rollout_id.decode(), payload, delivery_count)


STREAM_BACKENDS["redis"] = RedisRolloutStream
