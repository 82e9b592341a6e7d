"""Atomic checkpoint files: write to a temporary file in the same folder, fsync, rename.

Invariant: at `path` there is either the previous complete checkpoint or the new complete
one, never a torn file, whatever moment the process dies (`os.replace` is atomic within a
filesystem). A resumed trainer continues from exactly the state of the last checkpoint:
model, optimiser(s), step, policy version and the caller's stream position.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

FORMAT_VERSION = 1


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> Path:
    """Write `state` (tensors, dicts, numbers, strings) atomically to `path`."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save({"format": FORMAT_VERSION, **state}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)
    return target


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    state = torch.load(Path(path), map_location="cpu", weights_only=False)
    if state.get("format") != FORMAT_VERSION:
        raise ValueError(
            f"{path}: checkpoint format {state.get('format')}, expected {FORMAT_VERSION}"
        )
    return state
