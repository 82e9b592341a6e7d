"""SQLite rollout stream: the local default, shared by every process on one machine.

`rlsys run` without Redis runs workers and the trainer in separate Ray worker processes;
an in-process stream cannot connect them, a file can. One SQLite file (WAL) may hold several
streams (the `stream` column); each keeps a consumer-group table and a pending table with
the semantics of a Redis consumer group (see `rlsys.ledger.stream`).

Invariants (per stream and group): every operation is one `BEGIN IMMEDIATE` transaction,
so it is atomic against every other process; `last_delivered` only grows, so `read` never
hands an entry out twice; only `reclaim` redelivers, and only entries still pending; an
acked entry leaves the pending table (and, with `delete_acked`, the file) for good.
Entries survive the processes that wrote them: a resumed job reads what its last run left.
Entry ids are "0-SEQ", SEQ from one AUTOINCREMENT counter, so they grow with publish order.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from rlsys.ledger.sequence_ids import entry_sequence, sequence_entry_id
from rlsys.ledger.stream import (
    STREAM_BACKENDS,
    Payload,
    PendingEntry,
    SqliteStreamConfig,
    StreamEntry,
    StreamError,
    StreamPosition,
    decode_payload,
    encode_payload,
)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
  seq INTEGER PRIMARY KEY AUTOINCREMENT, stream TEXT NOT NULL, rollout_id TEXT NOT NULL,
  kind BLOB NOT NULL, data BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS entries_stream_seq ON entries (stream, seq);
CREATE INDEX IF NOT EXISTS entries_stream_rollout ON entries (stream, rollout_id);
CREATE TABLE IF NOT EXISTS groups (
  stream TEXT NOT NULL, name TEXT NOT NULL, last_delivered INTEGER NOT NULL DEFAULT 0,
  PRIMARY KEY (stream, name));
CREATE TABLE IF NOT EXISTS pending (
  stream TEXT NOT NULL, grp TEXT NOT NULL, seq INTEGER NOT NULL, consumer TEXT NOT NULL,
  delivered_at REAL NOT NULL, count INTEGER NOT NULL, PRIMARY KEY (stream, grp, seq));
"""

# A blocking read polls: SQLite has no cross-process notification. 20 ms is far below a
# rollout's duration and costs one indexed query per poll.
_POLL_S = 0.02


class SqliteRolloutStream:
    """A `RolloutStream` in a SQLite file, safe across threads and processes."""

    def __init__(self, config: SqliteStreamConfig) -> None:
        self.config = config
        self.name, self.group = config.stream, config.group
        Path(config.path).parent.mkdir(parents=True, exist_ok=True)
        # isolation_level=None: transactions are explicit (BEGIN IMMEDIATE takes the write
        # lock up front, so two readers never both hand out the same entry).
        self._db = sqlite3.connect(
            config.path, timeout=config.busy_timeout_s, isolation_level=None,
            check_same_thread=False,
        )  # fmt: skip
        self._lock = threading.Lock()  # one connection, shared by an actor's threads
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        for statement in _SCHEMA.split(";"):
            if statement.strip():
                self._db.execute(statement)
        with self._tx() as db:
            db.execute(
                "INSERT OR IGNORE INTO groups (stream, name) VALUES (?, ?)", (self.name, self.group)
            )

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as exc:
                msg = f"SQLite stream {self.name!r} at {self.config.path}: {exc}"
                raise StreamError(msg) from exc
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _last_delivered(self, db: sqlite3.Connection) -> int:
        row = db.execute(
            "SELECT last_delivered FROM groups WHERE stream = ? AND name = ?",
            (self.name, self.group),
        ).fetchone()
        if row is None:
            raise StreamError(f"SQLite stream {self.name!r} has no group {self.group!r}")
        return int(row[0])

    def publish(self, rollout_id: str, payload: Payload) -> str:
        return self.publish_many([(rollout_id, payload)])[0]

    def publish_many(self, items: Sequence[tuple[str, Payload]]) -> list[str]:
        encoded = [(rollout_id, *encode_payload(payload)) for rollout_id, payload in items]
        ids = []
        with self._tx() as db:
            for rollout_id, kind, data in encoded:
                have = db.execute(  # idempotent: a retried publish finds its entry
                    "SELECT seq FROM entries WHERE stream = ? AND rollout_id = ?",
                    (self.name, rollout_id),
                ).fetchone()
                if have is not None:
                    ids.append(sequence_entry_id(int(have[0])))
                    continue
                cur = db.execute(
                    "INSERT INTO entries (stream, rollout_id, kind, data) VALUES (?, ?, ?, ?)",
                    (self.name, rollout_id, kind, data),
                )
                ids.append(sequence_entry_id(int(cur.lastrowid or 0)))
        return ids

    def read(self, consumer: str, count: int = 1, block_ms: int | None = None) -> list[StreamEntry]:
        deadline = time.monotonic() + (block_ms or 0) / 1000
        while True:
            out = self._read_once(consumer, count)
            if out or block_ms is None or time.monotonic() >= deadline:
                return out
            time.sleep(min(_POLL_S, max(0.0, deadline - time.monotonic())))

    def _read_once(self, consumer: str, count: int) -> list[StreamEntry]:
        with self._tx() as db:
            last = self._last_delivered(db)
            rows = db.execute(
                "SELECT seq, rollout_id, kind, data FROM entries WHERE stream = ? AND seq > ? "
                "ORDER BY seq LIMIT ?",
                (self.name, last, count),
            ).fetchall()
            if not rows:
                return []
            now = time.time()
            db.executemany(
                "INSERT OR REPLACE INTO pending VALUES (?, ?, ?, ?, ?, 1)",
                [(self.name, self.group, seq, consumer, now) for seq, *_ in rows],
            )
            db.execute(
                "UPDATE groups SET last_delivered = ? WHERE stream = ? AND name = ?",
                (rows[-1][0], self.name, self.group),
            )
        return [
            StreamEntry(sequence_entry_id(seq), rid, decode_payload(bytes(kind), bytes(data)))
            for seq, rid, kind, data in rows
        ]

    def ack(self, entry_ids: Sequence[str]) -> int:
        acked = 0
        with self._tx() as db:
            for seq in (entry_sequence(i, "a SQLite stream") for i in entry_ids):
                cur = db.execute(
                    "DELETE FROM pending WHERE stream = ? AND grp = ? AND seq = ?",
                    (self.name, self.group, seq),
                )
                if cur.rowcount:
                    acked += 1
                    if self.config.delete_acked:
                        db.execute("DELETE FROM entries WHERE seq = ?", (seq,))
        return acked

    def reclaim(self, consumer: str, min_idle_ms: int, count: int = 100) -> list[StreamEntry]:
        out: list[StreamEntry] = []
        with self._tx() as db:
            now = time.time()
            rows = db.execute(
                "SELECT p.seq, p.count, e.rollout_id, e.kind, e.data FROM pending p "
                "LEFT JOIN entries e ON e.seq = p.seq "
                "WHERE p.stream = ? AND p.grp = ? AND p.delivered_at <= ? ORDER BY p.seq",
                (self.name, self.group, now - min_idle_ms / 1000),
            ).fetchall()
            for seq, n, rid, kind, data in rows:
                if len(out) == count:
                    break
                if rid is None:  # deleted while pending: drop it, as XAUTOCLAIM does
                    db.execute(
                        "DELETE FROM pending WHERE stream = ? AND grp = ? AND seq = ?",
                        (self.name, self.group, seq),
                    )
                    continue
                db.execute(
                    "UPDATE pending SET consumer = ?, delivered_at = ?, count = ? "
                    "WHERE stream = ? AND grp = ? AND seq = ?",
                    (consumer, now, n + 1, self.name, self.group, seq),
                )
                payload = decode_payload(bytes(kind), bytes(data))
                out.append(StreamEntry(sequence_entry_id(seq), rid, payload, n + 1))
        return out

    def pending(self, consumer: str | None = None, count: int = 1000) -> list[PendingEntry]:
        with self._tx() as db:
            rows = db.execute(
                "SELECT seq, consumer, delivered_at, count FROM pending "
                "WHERE stream = ? AND grp = ? AND (? IS NULL OR consumer = ?) "
                "ORDER BY seq LIMIT ?",
                (self.name, self.group, consumer, consumer, count),
            ).fetchall()
        now = time.time()
        return [
            PendingEntry(sequence_entry_id(seq), who, int((now - at) * 1000), n)
            for seq, who, at, n in rows
        ]

    def position(self) -> StreamPosition:
        with self._tx() as db:
            last = self._last_delivered(db)
            (pending,) = db.execute(
                "SELECT count(*) FROM pending WHERE stream = ? AND grp = ?",
                (self.name, self.group),
            ).fetchone()
            backlog, length = db.execute(
                "SELECT coalesce(sum(seq > ?), 0), count(*) FROM entries WHERE stream = ?",
                (last, self.name),
            ).fetchone()
        return StreamPosition(sequence_entry_id(last), int(pending), int(backlog), int(length))

    def delete(self) -> None:
        with self._tx() as db:
            for table in ("entries", "groups", "pending"):
                db.execute(f"DELETE FROM {table} WHERE stream = ?", (self.name,))  # noqa: S608

    def close(self) -> None:
        with self._lock:
            self._db.close()


STREAM_BACKENDS["sqlite"] = SqliteRolloutStream
