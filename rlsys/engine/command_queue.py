"""The mailbox of an engine's scheduler thread: commands from any thread, run between steps.

Both engine backends (`InferenceEngine`, `VllmEngine`) drive their engine from one
scheduler thread. Callers on other threads never touch the engine: they hand the thread a
command (add a request, abort one, load weights, read stats), and the thread runs every
queued command between two engine steps, never during one (docs/ARCHITECTURE.md,
"Engines and policy models").

Invariants: a command is accepted only while the queue is open (`submit` raises once it is
closed); accepted commands run in the order they were accepted, each exactly once: on the
scheduler thread, or, for those it never took, in `close` once that thread has stopped, so
a caller waiting on an accepted command is always answered. Garbage collections of a
process that owns its engine run after a step, never inside one (`gc_steps`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from rlsys.engine import gc_steps

T = TypeVar("T")

Command = Callable[[], None]


class CommandQueue:
    def __init__(self) -> None:
        self._commands: list[Command] = []
        self._wake = threading.Condition()
        self._closed = False

    def submit(self, command: Command) -> None:
        """Queue `command` for the scheduler thread; RuntimeError once the engine is closed."""
        with self._wake:
            if self._closed:
                raise RuntimeError("engine is closed")
            self._commands.append(command)
            self._wake.notify()

    def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the scheduler thread between two steps; its value, or its exception."""
        done: Future[T] = Future()

        def run() -> None:
            try:
                done.set_result(fn())
            except Exception as err:
                done.set_exception(err)

        self.submit(run)
        return done.result()

    def serve(self, has_work: Callable[[], bool], step: Callable[[], None]) -> None:
        """The scheduler thread's loop, until `close`: sleep while there is neither a
        command nor work; run the queued commands; then one `step` if there is work; then
        the collections `gc_steps` asks for (none unless the process took over)."""
        while True:
            with self._wake:
                while not self._commands and not has_work() and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                commands, self._commands = self._commands, []
            for command in commands:
                command()
            if has_work():
                step()
            # also after commands alone: an idle engine's callers allocate too
            gc_steps.after_step(idle=not has_work())

    def close(self, loop: threading.Thread) -> bool:
        """Stop accepting, wait for `loop` (the thread running `serve`) to return, then run
        here, in order, the commands it never took. False when already closed."""
        with self._wake:
            if self._closed:
                return False
            self._closed = True
            self._wake.notify()
        loop.join()
        leftover, self._commands = self._commands, []
        for command in leftover:
            command()
        return True
