"""An asyncio face for any `Sandbox`: the same calls, run on a worker thread.

Invariant: one `AsyncSandbox` runs one call at a time (a lock), so an async rollout cannot
interleave two commands in one workspace by accident.

Caveat: bwrap's `--die-with-parent` follows the *thread* that started it. The default
executor keeps its worker threads alive while the loop runs, so this holds here; do not
launch sandboxes from short-lived threads.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from types import TracebackType

from rlsys.sandboxes.base import Command, RunResult, Sandbox


class AsyncSandbox:
    def __init__(self, sandbox: Sandbox) -> None:
        self.sandbox = sandbox
        self._lock = asyncio.Lock()

    async def run(
        self,
        command: Command,
        *,
        timeout_s: float | None = None,
        stdin: bytes | None = None,
        env: Mapping[str, str] | None = None,
    ) -> RunResult:
        async with self._lock:
            return await asyncio.to_thread(
                self.sandbox.run, command, timeout_s=timeout_s, stdin=stdin, env=env
            )

    async def write_file(self, path: str, data: bytes | str) -> None:
        async with self._lock:
            await asyncio.to_thread(self.sandbox.write_file, path, data)

    async def read_file(self, path: str, max_bytes: int | None = None) -> bytes:
        async with self._lock:
            return await asyncio.to_thread(self.sandbox.read_file, path, max_bytes)

    async def close(self) -> None:
        async with self._lock:
            await asyncio.to_thread(self.sandbox.close)

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()
