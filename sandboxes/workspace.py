"""Per-sandbox workspace folders on the host, with an owner record the reaper can trust.

Layout under the workspace root (one folder per sandbox):

    <root>/<sandbox_id>/owner.json      who owns it: host, pid, pid start time, backend
    <root>/<sandbox_id>/running/<pgid>  one file per command in flight (its process group)
    <root>/<sandbox_id>/work/           the workspace itself; only this is shown to the sandbox

Invariants:
- The sandbox sees only `work/`; the owner record and the run records sit beside it.
- Host-side reads and writes never follow a symlink (sandboxed code controls `work/` and could
  plant `work/x -> /etc/shadow`), and never leave `work/` (no absolute paths, no `..`).
- A process is identified by (pid, start time), so a recycled pid never passes for the owner.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from rlsys.sandboxes.base import WORKSPACE_MOUNT, SandboxError

OWNER_FILE = "owner.json"


def process_start_time(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot (/proc/PID/stat field 22); None if gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    fields = raw[raw.rindex(b")") + 2 :].split()
    return int(fields[19])


def is_alive(pid: int, start_time: int | None) -> bool:
    return start_time is not None and process_start_time(pid) == start_time


@dataclass
class Workspace:
    """One sandbox's folder on the host. `path` is what the sandbox sees as its workspace."""

    root: Path  # <root>/<sandbox_id>
    owner_uid: int | None  # chown new files to this uid (bwrap started by root), else None

    @property
    def path(self) -> Path:
        return self.root / "work"

    @property
    def sandbox_id(self) -> str:
        return self.root.name

    @classmethod
    def create(cls, workspace_root: Path, backend: str, owner_uid: int | None = None) -> Workspace:
        workspace_root.mkdir(parents=True, exist_ok=True)
        # Other host users must not browse sandboxes; the sandbox uid only needs to pass through.
        os.chmod(workspace_root, 0o711)
        root = workspace_root / f"{backend}-{uuid.uuid4().hex[:12]}"
        root.mkdir(mode=0o711)
        (root / "running").mkdir(mode=0o700)
        owner = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "start_time": process_start_time(os.getpid()),
            "backend": backend,
            "created": time.time(),
        }
        (root / OWNER_FILE).write_text(json.dumps(owner))
        work = root / "work"
        work.mkdir(mode=0o755)
        if owner_uid is not None:
            os.chown(work, owner_uid, owner_uid)
        return cls(root=root, owner_uid=owner_uid)

    @contextmanager
    def track(self, pgid: int) -> Iterator[None]:
        """Record a command's process group while it runs, for the reaper if we die."""
        record = self.root / "running" / str(pgid)
        record.write_text(json.dumps({"pgid": pgid, "start_time": process_start_time(pgid)}))
        try:
            yield
        finally:
            record.unlink(missing_ok=True)

    def write_file(self, path: str, data: bytes | str) -> None:
        parts = _relative_parts(path)
        payload = data.encode() if isinstance(data, str) else data
        dir_fd = self._open_dir(parts[:-1], create=True)
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(parts[-1], flags, 0o644, dir_fd=dir_fd)
            try:
                if self.owner_uid is not None:
                    os.fchown(fd, self.owner_uid, self.owner_uid)
                view = memoryview(payload)
                while view:
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
        finally:
            os.close(dir_fd)

    def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
        parts = _relative_parts(path)
        dir_fd = self._open_dir(parts[:-1], create=False)
        try:
            fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise SandboxError(f"{path}: not a regular file")
            return f.read() if max_bytes is None else f.read(max_bytes)

    def _open_dir(self, parts: list[str], create: bool) -> int:
        """Open `work/<parts...>` one component at a time, refusing symlinks at every step."""
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(self.path, flags)
        for part in parts:
            if create:
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                    if self.owner_uid is not None:
                        os.chown(part, self.owner_uid, self.owner_uid, dir_fd=fd)
                except FileExistsError:
                    pass
            try:
                next_fd = os.open(part, flags, dir_fd=fd)
            finally:
                os.close(fd)
            fd = next_fd
        return fd

    def remove(self) -> None:
        remove_tree(self.root)


def _relative_parts(path: str) -> list[str]:
    """Split a workspace path; absolute paths must lie under the in-sandbox mount point."""
    pure = PurePosixPath(path)
    if pure.is_absolute():
        try:
            pure = pure.relative_to(WORKSPACE_MOUNT)
        except ValueError as err:
            raise SandboxError(f"{path}: outside the workspace {WORKSPACE_MOUNT}") from err
    parts = [p for p in pure.parts if p != "."]
    if not parts or ".." in parts:
        raise SandboxError(f"{path!r}: not a file path inside the workspace")
    return parts


def remove_tree(path: Path) -> None:
    """rm -rf that also handles folders the sandbox made unreadable (chmod 000).

    Called only after every sandboxed process is dead, so nothing swaps a folder for a
    symlink between the check and the chmod.
    """
    if not path.exists():
        return
    for dirpath, dirnames, _ in os.walk(path):
        for name in dirnames:
            child = os.path.join(dirpath, name)
            if not os.path.islink(child):
                os.chmod(child, 0o700)  # before os.walk descends into it
    shutil.rmtree(path)
