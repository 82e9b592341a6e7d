"""The rollout stream: how finished rollouts travel from rollout workers to the trainer.

Producers `publish` entries (a rollout id and its payload); consumers, named and members of
one consumer group, `read` them and `ack` them. The contract every backend keeps:

- An entry is delivered to one consumer of the group at a time and stays *pending* on that
  consumer until it is acknowledged. Acknowledge only after the work that consumed the
  entry is committed (for the trainer: the optimiser step is recorded in the ledger), so a
  crash between read and commit loses nothing.
- An acknowledged entry is never delivered again. An unacknowledged one is delivered again
  only through `reclaim`, which moves entries idle for at least `min_idle_ms` (their
  consumer is presumed dead) to a live consumer, or through `resume_consumer`.
- Publishing is idempotent per rollout id: publishing a rollout id whose entry is still in
  the stream returns that entry's id and adds nothing, so a publish retried after a lost
  reply (a Redis restart) cannot deliver a rollout twice.
- Within the group, new entries are delivered in publish order; entry ids increase with
  publish order (`entry_id_key` makes them comparable).
- With `delete_acked` (the default) an acknowledged entry is also removed from the stream,
  so the stream holds only pending and undelivered entries and its size stays bounded. A
  stream read by several groups must turn this off.

Batches are the normal path: `publish_many`, `read(count=N)` and `ack([...])` cost one round
trip each. Backends register themselves in `STREAM_BACKENDS`; `open_stream` builds one from
a URL (`memory://NAME`, `redis://HOST:PORT/DB?stream=KEY&group=NAME`,
`sqlite:///PATH?stream=NAME`) or a config. The in-memory backend serves one process only;
the SQLite one is the local default across processes; Redis serves a cluster.
"""

from __future__ import annotations

import importlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Protocol, TypeAlias, runtime_checkable
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

Payload: TypeAlias = Any
"""A JSON-serialisable value, or `bytes` (passed through untouched)."""

KIND_JSON = b"j"
KIND_BYTES = b"b"


class StreamError(RuntimeError):
    """The stream backend refused an operation; the message names the stream."""


class StreamConnectionError(StreamError):
    """The stream backend cannot be reached; the message names the URL."""


@dataclass(frozen=True, slots=True)
class StreamEntry:
    """One delivered entry. `delivery_count` is 1 on first delivery, higher after reclaims."""

    entry_id: str
    rollout_id: str
    payload: Payload
    delivery_count: int = 1


@dataclass(frozen=True, slots=True)
class PendingEntry:
    """An entry delivered to `consumer` and not yet acknowledged."""

    entry_id: str
    consumer: str
    idle_ms: int
    delivery_count: int


@dataclass(frozen=True, slots=True)
class StreamPosition:
    """Where the group stands; what a trainer checkpoint records and checks on resume.

    `last_delivered_id` is the newest entry ever handed to the group ("0-0" before any);
    `pending` entries were delivered but not acknowledged; `backlog` entries were published
    and never delivered. Entries acknowledged so far = delivered - pending.
    """

    last_delivered_id: str
    pending: int
    backlog: int
    length: int


class MemoryStreamConfig(BaseModel):
    """An in-process stream, shared by every handle opened with the same `name`."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["memory"] = "memory"
    name: str = Field("rollouts", min_length=1, description="Process-wide name of the stream.")
    group: str = Field("trainer", min_length=1, description="Consumer group of this handle.")
    delete_acked: bool = Field(True, description="Drop an entry once this group acks it.")


class RedisStreamConfig(BaseModel):
    """A Redis Stream with a consumer group; survives the death of any consumer."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["redis"] = "redis"
    url: str = Field("redis://127.0.0.1:6379/0", description="redis-py connection URL.")
    stream: str = Field("rlsys:rollouts", min_length=1, description="Key of the stream.")
    group: str = Field("trainer", min_length=1, description="Consumer group of this handle.")
    delete_acked: bool = Field(True, description="XDEL an entry once this group acks it.")
    socket_timeout_s: float = Field(
        30.0, gt=0, description="Socket timeout; must exceed the longest blocking read."
    )


class SqliteStreamConfig(BaseModel):
    """A stream in a SQLite file: durable, and shared by every process of one machine."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["sqlite"] = "sqlite"
    path: str = Field(min_length=1, description="The SQLite file (created if missing).")
    stream: str = Field("rollouts", min_length=1, description="Name of the stream in the file.")
    group: str = Field("trainer", min_length=1, description="Consumer group of this handle.")
    delete_acked: bool = Field(True, description="Delete an entry once this group acks it.")
    busy_timeout_s: float = Field(
        30.0, gt=0, description="How long a writer waits for another process's lock."
    )


AnyStreamConfig: TypeAlias = MemoryStreamConfig | RedisStreamConfig | SqliteStreamConfig
StreamConfig = Annotated[AnyStreamConfig, Field(discriminator="type")]
_CONFIG_ADAPTER: TypeAdapter[AnyStreamConfig] = TypeAdapter(StreamConfig)


@runtime_checkable
class RolloutStream(Protocol):
    """A stream of finished rollouts read by one consumer group (see the module docstring)."""

    @property
    def name(self) -> str: ...

    @property
    def group(self) -> str: ...

    def publish(self, rollout_id: str, payload: Payload) -> str:
        """Append one entry; returns its id."""
        ...

    def publish_many(self, items: Sequence[tuple[str, Payload]]) -> list[str]:
        """Append `(rollout_id, payload)` pairs in order, in one round trip; returns ids."""
        ...

    def read(self, consumer: str, count: int = 1, block_ms: int | None = None) -> list[StreamEntry]:
        """Deliver up to `count` never-delivered entries to `consumer`, oldest first.

        `block_ms=None` returns at once; otherwise waits up to `block_ms` for an entry.
        """
        ...

    def ack(self, entry_ids: Sequence[str]) -> int:
        """Acknowledge pending entries; returns how many were pending. Idempotent."""
        ...

    def reclaim(self, consumer: str, min_idle_ms: int, count: int = 100) -> list[StreamEntry]:
        """Move up to `count` entries pending for at least `min_idle_ms` to `consumer`.

        Oldest first. A claim restarts the entry's idle clock and counts as a delivery.
        """
        ...

    def pending(self, consumer: str | None = None, count: int = 1000) -> list[PendingEntry]:
        """The oldest `count` pending entries of the group (or of one consumer)."""
        ...

    def position(self) -> StreamPosition: ...

    def delete(self) -> None:
        """Remove the stream and all its groups (tests, end of a job)."""
        ...

    def close(self) -> None: ...


STREAM_BACKENDS: dict[str, type[RolloutStream]] = {}
"""Backend name -> class taking its config. Each backend module registers itself."""

_BACKEND_MODULES = (
    "rlsys.ledger.memory_stream",
    "rlsys.ledger.redis_stream",
    "rlsys.ledger.sqlite_stream",
)
_URL_SCHEMES = {
    "memory": "memory",
    "redis": "redis",
    "rediss": "redis",
    "unix": "redis",
    "sqlite": "sqlite",
}
_REDIS_STREAM_PARAMS = ("stream", "group", "delete_acked", "socket_timeout_s")


def stream_backends() -> dict[str, type[RolloutStream]]:
    """The registry, with every backend module imported (so every backend is in it)."""
    for module in _BACKEND_MODULES:
        importlib.import_module(module)
    return STREAM_BACKENDS


def _import_backend(backend: str) -> None:
    # Only the backend in use: redis-py is not imported by a job that does not use Redis.
    importlib.import_module(f"rlsys.ledger.{backend}_stream")


def parse_stream_url(url: str) -> AnyStreamConfig:
    """`memory://NAME?group=G`, `redis://HOST:PORT/DB?stream=KEY&group=G` or
    `sqlite:///PATH?stream=NAME&group=G` -> a config."""
    parts = urlsplit(url)
    backend = _URL_SCHEMES.get(parts.scheme)
    if backend is None:
        known = ", ".join(f"{s}://" for s in _URL_SCHEMES)
        raise ValueError(f"stream URL {url!r}: unknown scheme {parts.scheme!r} (known: {known})")
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    if backend == "memory":
        fields: dict[str, Any] = {"type": "memory", **query}
        name = (parts.netloc + parts.path).strip("/")
        if name:
            fields["name"] = name
    elif backend == "sqlite":
        fields = {"type": "sqlite", "path": parts.path, **query}
    else:
        fields = {"type": "redis"}
        fields.update({k: query.pop(k) for k in _REDIS_STREAM_PARAMS if k in query})
        # Everything else in the query (socket_keepalive, ...) is redis-py's business.
        fields["url"] = urlunsplit(parts._replace(query=urlencode(query)))
    try:
        return _CONFIG_ADAPTER.validate_python(fields)
    except ValueError as exc:
        raise ValueError(f"stream URL {url!r}: {exc}") from exc


def open_stream(url_or_config: str | AnyStreamConfig) -> RolloutStream:
    """Open (creating if needed) the stream and its consumer group."""
    config = parse_stream_url(url_or_config) if isinstance(url_or_config, str) else url_or_config
    _import_backend(config.type)
    return STREAM_BACKENDS[config.type](config)  # type: ignore[call-arg]


def resume_consumer(
    stream: RolloutStream, consumer: str, committed_ids: Sequence[str], min_idle_ms: int = 0
) -> list[StreamEntry]:
    """Bring a restarted consumer back to exactly where its last commit left it.

    `committed_ids` are the entries the checkpoint says were consumed by committed work: the
    crash may have come between that commit and the ack, so they are acked now and never
    repeated. Every other pending entry idle for `min_idle_ms` (0: this is the group's only
    consumer) is taken over and returned, to be redone; nothing is skipped. Afterwards
    `read` continues with entries never delivered.
    """
    stream.ack(committed_ids)
    # One reclaim pass sized to the whole pending list: a second pass with min_idle_ms=0
    # would claim again what the first one just handed to `consumer`.
    pending = stream.position().pending
    return stream.reclaim(consumer, min_idle_ms, count=pending) if pending else []


def entry_id_key(entry_id: str) -> tuple[int, int]:
    """Sort key of an entry id ("MS-SEQ", as Redis writes them): publish order."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def encode_payload(payload: Payload) -> tuple[bytes, bytes]:
    """(kind, data): bytes pass through; anything else must be JSON-serialisable.

    Every backend encodes, the in-memory one too, so a payload is checked, and copied away
    from the producer's later mutations, at the same moment whatever the backend.
    """
    if isinstance(payload, bytes | bytearray | memoryview):
        return KIND_BYTES, bytes(payload)
    return KIND_JSON, json.dumps(payload, separators=(",", ":")).encode()


def decode_payload(kind: bytes, data: bytes) -> Payload:
    # Decoding first skips json's pure-Python sniffing of the bytes' encoding.
    return data if kind == KIND_BYTES else json.loads(data.decode())


def publish_patiently(
    stream: RolloutStream,
    rollout_id: str,
    payload: Payload,
    *,
    within_s: float,
    first_delay_s: float = 0.2,
    max_delay_s: float = 5.0,
) -> tuple[str, int]:
    """Publish one entry, retrying while the stream is unreachable (bounded exponential
    backoff) for up to `within_s`; returns the entry id and how many retries it took.
    Retrying is safe because publishing is idempotent per rollout id. Raises the last
    `StreamConnectionError` once `within_s` has passed."""
    deadline = time.monotonic() + within_s
    delay, retries = first_delay_s, 0
    while True:
        try:
            return stream.publish(rollout_id, payload), retries
        except StreamConnectionError:
            left = deadline - time.monotonic()
            if left <= 0:
                raise
            time.sleep(min(delay, left))
            delay, retries = min(delay * 2, max_delay_s), retries + 1
