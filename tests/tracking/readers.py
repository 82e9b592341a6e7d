"""Reading back what the trackers wrote, from their files, with their own record formats.

W&B's offline run file (`run-ID.wandb`) is a LevelDB-style log of protobuf `Record`s: a
7-byte file header, then 32 KiB blocks of chunks (crc32, length, type: full, first, middle,
last), a block's tail too short for a chunk header left as padding. TensorBoard's event
file is TFRecord framing (length, its masked crc, data, its masked crc) around `Event`s.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections import defaultdict
from pathlib import Path
from typing import Any

_BLOCK, _CHUNK_HEADER = 32768, 7
_FULL, _LAST = 1, 4


def wandb_records(run_file: Path) -> list[Any]:
    from wandb.proto import wandb_internal_pb2 as pb

    data = run_file.read_bytes()
    ident, magic, _version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic) == (b":W&B", 0xBEE1), "not a W&B run file"
    records, pending, pos = [], b"", 7
    while pos + _CHUNK_HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _CHUNK_HEADER:
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + _CHUNK_HEADER])
        if kind == 0 and length == 0:  # zero padding up to the next block
            pos += left
            continue
        chunk = data[pos + _CHUNK_HEADER : pos + _CHUNK_HEADER + length]
        assert zlib.crc32(bytes([kind]) + chunk) == crc, f"corrupt chunk at {pos}"
        pos += _CHUNK_HEADER + length
        pending += chunk
        if kind in (_FULL, _LAST):
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def _key(item: Any) -> str:
    return item.key or "/".join(item.nested_key)


def wandb_run(run_file: Path) -> dict[str, Any]:
    """History by step, the config and the final summary of an offline W&B run."""
    history: dict[int, dict[str, Any]] = {}
    config: dict[str, Any] = {}
    summary: dict[str, Any] = {}
    exit_code = None
    for r in wandb_records(run_file):
        kind = r.WhichOneof("record_type")
        if kind == "history":
            row = {_key(i): json.loads(i.value_json) for i in r.history.item}
            history[int(row["_step"])] = row
        elif kind == "run":
            config.update({_key(i): json.loads(i.value_json) for i in r.run.config.update})
        elif kind == "config":
            config.update({_key(i): json.loads(i.value_json) for i in r.config.update})
        elif kind == "summary":
            summary.update({_key(i): json.loads(i.value_json) for i in r.summary.update})
        elif kind == "exit":
            exit_code = r.exit.exit_code
    return {"history": history, "config": config, "summary": summary, "exit_code": exit_code}


def tensorboard_scalars(directory: Path) -> dict[str, dict[int, float]]:
    """tag -> step -> value of every scalar in a directory's event files."""
    from tensorboardX.proto import event_pb2

    out: dict[str, dict[int, float]] = defaultdict(dict)
    for path in sorted(directory.glob("events.out.tfevents.*")):
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            event = event_pb2.Event()
            event.ParseFromString(data[pos + 12 : pos + 12 + length])
            pos += 12 + length + 4
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    out[value.tag][event.step] = value.simple_value
    return dict(out)
