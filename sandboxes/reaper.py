"""Start-up reaper: tear down sandboxes whose owner process died without closing them.

A sandbox folder is an orphan when its owner record names this host and a (pid, start
time) that is no longer running. For each orphan the reaper SIGKILLs the process groups
recorded under `running/` that still have members, then removes the folder. Docker
containers are reaped by `rlsys.sandboxes.docker_backend.reap_containers` (same rule,
owner read from container labels).

Invariants:
- A live owner's sandbox is never touched, on this host or another sharing the folder.
- A folder with no owner record is reaped only once it is older than `CREATE_GRACE_S`
  (it may be a sandbox being created right now).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from rlsys.sandboxes.config import default_workspace_root
from rlsys.sandboxes.workspace import OWNER_FILE, is_alive, remove_tree

CREATE_GRACE_S = 60.0


@dataclass
class ReapReport:
    removed_workspaces: list[str] = field(default_factory=list)
    killed_groups: list[int] = field(default_factory=list)
    removed_containers: list[str] = field(default_factory=list)


def reap_orphans(workspace_root: Path | None = None) -> ReapReport:
    """Remove orphaned workspaces under `workspace_root` and kill what they left running."""
    root = workspace_root if workspace_root is not None else default_workspace_root()
    report = ReapReport()
    if not root.is_dir():
        return report
    for folder in sorted(root.iterdir()):
        if folder.is_dir() and _is_orphan(folder):
            report.killed_groups += _kill_recorded_groups(folder / "running")
            remove_tree(folder)
            report.removed_workspaces.append(folder.name)
    return report


def _is_orphan(folder: Path) -> bool:
    try:
        owner = json.loads((folder / OWNER_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return time.time() - folder.stat().st_mtime > CREATE_GRACE_S
    if owner.get("host") != socket.gethostname():
        return False
    return not is_alive(int(owner["pid"]), owner.get("start_time"))


def _kill_recorded_groups(running: Path) -> list[int]:
    killed = []
    for record in running.glob("*") if running.is_dir() else []:
        pgid = int(record.name)
        # Only a group that still has members: an empty pgid may be reused by anyone later.
        if _group_has_members(pgid):
            try:
                os.killpg(pgid, signal.SIGKILL)
                killed.append(pgid)
            except ProcessLookupError:
                pass
    return killed


def _group_has_members(pgid: int) -> bool:
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        try:
            raw = stat_file.read_bytes()
        except OSError:
            continue
        if int(raw[raw.rindex(b")") + 2 :].split()[2]) == pgid:
            return True
    return False
