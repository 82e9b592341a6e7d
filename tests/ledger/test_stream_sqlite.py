"""The SQLite stream across processes: what `rlsys run` relies on without Redis (workers
and the trainer are separate Ray worker processes). The shared contract is in
test_stream_contract.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rlsys.ledger.stream import SqliteStreamConfig, open_stream

pytestmark = pytest.mark.unit

# Publishes three entries, reads two as consumer "dead", and exits without acking them.
OTHER_PROCESS = """
import sys
from rlsys.ledger.stream import SqliteStreamConfig, open_stream
stream = open_stream(SqliteStreamConfig(path=sys.argv[1]))
stream.publish_many([(f"r{i}", b"traj") for i in range(3)])
print(" ".join(e.entry_id for e in stream.read("dead", count=2)))
"""


def test_entries_of_an_exited_process_are_read_and_reclaimed_here(tmp_path: Path) -> None:
    path = str(tmp_path / "stream.db")
    out = subprocess.run(
        [sys.executable, "-c", OTHER_PROCESS, path],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    stream = open_stream(SqliteStreamConfig(path=path))
    reclaimed = stream.reclaim("trainer", min_idle_ms=0)
    assert [e.entry_id for e in reclaimed] == out.stdout.split()
    assert [e.payload for e in reclaimed] == [b"traj", b"traj"]
    assert stream.ack([e.entry_id for e in reclaimed]) == 2
    assert [e.rollout_id for e in stream.read("trainer", count=10)] == ["r2"]
    assert stream.position().length == 1  # acked entries are gone from the file
