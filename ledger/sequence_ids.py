"""Entry ids of the stream backends that number their own entries (memory, SQLite).

Such a backend keeps one counter per log, SEQ, that grows with publish order, and writes an
entry's id as "0-SEQ": the Redis form ("MS-SEQ") with a zero time part, so
`rlsys.ledger.stream.entry_id_key` orders ids of every backend alike.

Invariant: `entry_sequence(sequence_entry_id(n), ...) == n`; any other string is a
`StreamError` (an id of another stream), never a silent wrong SEQ.
"""

from __future__ import annotations

from rlsys.ledger.stream import StreamError


def sequence_entry_id(seq: int) -> str:
    """The id of entry `seq`."""
    return f"0-{seq}"


def entry_sequence(entry_id: str, backend: str) -> int:
    """The SEQ of an id that `sequence_entry_id` wrote; `backend` names the kind of stream
    in the error for an id it did not write."""
    ms, _, seq = entry_id.partition("-")
    if ms != "0" or not seq.isdigit():
        raise StreamError(f"{entry_id!r} is not an id of {backend}")
    return int(seq)
