"""In-process rollout stream: the default backend, with the semantics of a Redis consumer group.

Handles opened with the same name share one `_MemoryLog` (producer and trainer in one
process, or one Ray actor hosting the stream). All state sits behind one condition
variable, so every operation is atomic with respect to every other, from any thread.

Invariants (per group): an entry is pending on at most one consumer; `last_delivered`
only grows, so `read` never hands out an entry twice; only `reclaim` redelivers, and only
entries still pending; an acked entry leaves the pending table (and, with `delete_acked`,
the log) for good. Nothing survives the process: use Redis when consumers may die.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from rlsys.ledger.sequence_ids import entry_sequence, sequence_entry_id
from rlsys.ledger.stream import (
    STREAM_BACKENDS,
    MemoryStreamConfig,
    Payload,
    PendingEntry,
    StreamEntry,
    StreamError,
    StreamPosition,
    decode_payload,
    encode_payload,
)


@dataclass(slots=True)
class _Delivery:
    consumer: str
    delivered_at: float
    count: int


@dataclass(slots=True)
class _Group:
    last_delivered: int = 0
    # seq -> delivery; insertion order is not id order after reclaims, so scans sort.
    pending: dict[int, _Delivery] = field(default_factory=dict)


@dataclass(slots=True)
class _MemoryLog:
    cond: threading.Condition = field(default_factory=threading.Condition)
    last_seq: int = 0
    entries: dict[int, tuple[str, bytes, bytes]] = field(default_factory=dict)
    by_rollout: dict[str, int] = field(default_factory=dict)  # idempotent publish
    groups: dict[str, _Group] = field(default_factory=dict)


_LOGS: dict[str, _MemoryLog] = {}
_LOGS_LOCK = threading.Lock()


class MemoryRolloutStream:
    """A `RolloutStream` held in this process's memory."""

    def __init__(self, config: MemoryStreamConfig) -> None:
        self.config = config
        self.name = config.name
        self.group = config.group
        with _LOGS_LOCK:
            self._log = _LOGS.setdefault(config.name, _MemoryLog())
        with self._log.cond:
            # A group created before the first publish sees every entry (Redis: id "0").
            self._log.groups.setdefault(config.group, _Group())

    @property
    def _group(self) -> _Group:
        group = self._log.groups.get(self.group)
        if group is None:
            raise StreamError(f"memory stream {self.name!r} has no group {self.group!r} (deleted?)")
        return group

    def publish(self, rollout_id: str, payload: Payload) -> str:
        return self.publish_many([(rollout_id, payload)])[0]

    def publish_many(self, items: Sequence[tuple[str, Payload]]) -> list[str]:
        encoded = [(rollout_id, *encode_payload(payload)) for rollout_id, payload in items]
        log = self._log
        ids = []
        with log.cond:
            for entry in encoded:
                seq = log.by_rollout.get(entry[0])
                if seq is None or seq not in log.entries:  # a retried publish finds its entry
                    seq = log.last_seq = log.last_seq + 1
                    log.entries[seq] = entry
                    log.by_rollout[entry[0]] = seq
                ids.append(sequence_entry_id(seq))
            log.cond.notify_all()
        return ids

    def read(self, consumer: str, count: int = 1, block_ms: int | None = None) -> list[StreamEntry]:
        log = self._log
        with log.cond:
            group = self._group
            if block_ms is not None:
                log.cond.wait_for(lambda: log.last_seq > group.last_delivered, block_ms / 1000)
            now = time.monotonic()
            out: list[StreamEntry] = []
            seq = group.last_delivered
            while seq < log.last_seq and len(out) < count:
                seq += 1
                entry = log.entries.get(seq)
                if entry is None:  # deleted by another group's ack: nothing to deliver
                    continue
                group.pending[seq] = _Delivery(consumer, now, 1)
                out.append(
                    StreamEntry(sequence_entry_id(seq), entry[0], decode_payload(*entry[1:]))
                )
            group.last_delivered = seq
            return out

    def ack(self, entry_ids: Sequence[str]) -> int:
        with self._log.cond:
            pending = self._group.pending
            acked = 0
            for seq in (entry_sequence(i, "an in-memory stream") for i in entry_ids):
                if pending.pop(seq, None) is not None:
                    acked += 1
                    if self.config.delete_acked:
                        entry = self._log.entries.pop(seq, None)
                        if entry is not None:
                            self._log.by_rollout.pop(entry[0], None)
            return acked

    def reclaim(self, consumer: str, min_idle_ms: int, count: int = 100) -> list[StreamEntry]:
        log = self._log
        with log.cond:
            now = time.monotonic()
            out: list[StreamEntry] = []
            pending = self._group.pending
            for seq in sorted(pending):
                if len(out) == count:
                    break
                delivery = pending[seq]
                if (now - delivery.delivered_at) * 1000 < min_idle_ms:
                    continue
                entry = log.entries.get(seq)
                if entry is None:  # deleted while pending: drop it, as XAUTOCLAIM does
                    del pending[seq]
                    continue
                delivery.consumer, delivery.delivered_at = consumer, now
                delivery.count += 1
                payload = decode_payload(*entry[1:])
                out.append(StreamEntry(sequence_entry_id(seq), entry[0], payload, delivery.count))
            return out

    def pending(self, consumer: str | None = None, count: int = 1000) -> list[PendingEntry]:
        with self._log.cond:
            now = time.monotonic()
            pending = self._group.pending
            rows: list[PendingEntry] = []
            for seq in sorted(pending):
                d = pending[seq]
                if len(rows) == count:
                    break
                if consumer is None or d.consumer == consumer:
                    idle_ms = int((now - d.delivered_at) * 1000)
                    rows.append(PendingEntry(sequence_entry_id(seq), d.consumer, idle_ms, d.count))
            return rows

    def position(self) -> StreamPosition:
        log = self._log
        with log.cond:
            group = self._group
            undelivered = range(group.last_delivered + 1, log.last_seq + 1)
            backlog = sum(1 for seq in undelivered if seq in log.entries)
            return StreamPosition(
                last_delivered_id=sequence_entry_id(group.last_delivered),
                pending=len(group.pending),
                backlog=backlog,
                length=len(log.entries),
            )

    def delete(self) -> None:
        with _LOGS_LOCK:
            _LOGS.pop(self.name, None)
        with self._log.cond:
            self._log.entries.clear()
            self._log.groups.clear()

    def close(self) -> None:
        """Nothing to release: the log lives as long as the process (or `delete`)."""


STREAM_BACKENDS["memory"] = MemoryRolloutStream
