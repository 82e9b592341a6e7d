"""Shared pieces of the scaffold tests: a bwrap sandbox factory that proves nothing leaks."""

from __future__ import annotations

from pathlib import Path

from rlsys.sandboxes.base import Sandbox
from rlsys.sandboxes.config import BwrapSandboxConfig, SandboxLimits
from rlsys.sandboxes.registry import open_sandbox


class CountingBwrap:
    """Opens real bwrap sandboxes under one root and remembers them."""

    def __init__(self, root: Path, wall_timeout_s: float = 20.0) -> None:
        self.root = root
        self.config = BwrapSandboxConfig(
            workspace_root=root, limits=SandboxLimits(wall_timeout_s=wall_timeout_s)
        )
        self.opened: list[Sandbox] = []

    def __call__(self) -> Sandbox:
        sandbox = open_sandbox(self.config)
        self.opened.append(sandbox)
        return sandbox

    def leftovers(self) -> list[Path]:
        return list(self.root.iterdir()) if self.root.exists() else []
