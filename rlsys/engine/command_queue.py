"""Commands for an engine's scheduler thread, run between two engine steps.

Both engine backends (`InferenceEngine`, `VllmEngine`) drive their engine from one thread;
callers on other threads hand it work through this queue.
Invariants: a command is accepted only while the queue is open; the loop takes accepted
commands in order; `close` returns the ones the loop never took (the owner runs them, so
nothing accepted is lost).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class CommandQueue:
    def __init__(self) -> None:
        self._commands: list[Callable[[], None]] = []
        self._wake = threading.Condition()
        self._closed = False

    def submit(self, fn: Callable[[], None]) -> None:
        """Queue `fn` for the scheduler thread; RuntimeError once the engine is closed."""
        with self._wake:
            if self._closed:
                raise RuntimeError("engine is closed")
            self._commands.append(fn)
            self._wake.notify()

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the scheduler thread between steps and return its value."""
        done: Future[Any] = Future()

        def run() -> None:
            try:
                done.set_result(fn())
            except Exception as err:
                done.set_exception(err)

        self.submit(run)
        return done.result()

    def take(self, has_work: Callable[[], bool]) -> list[Callable[[], None]] | None:
        """(Scheduler thread) wait for commands or work; the commands queued so far, or
        None once the queue is closed."""
        with self._wake:
            while not self._commands and not has_work() and not self._closed:
                self._wake.wait()
            if self._closed:
                return None
            commands, self._commands = self._commands, []
        return commands

    def close(self) -> list[Callable[[], None]] | None:
        """Stop accepting; the commands never taken, or None if already closed."""
        with self._wake:
            if self._closed:
                return None
            self._closed = True
            self._wake.notify()
            return self._commands
