"""`InferenceEngine`: the thread-safe facade the replica actor wraps.

Many threads call `generate` at once; one scheduler thread owns the `EngineCore` and runs
steps while there is work, so requests join and leave the batch at every step. Commands
(add, abort, weight update) are queued and applied between steps, never during one.

Invariants: every accepted `generate` call returns exactly one result (finished, aborted,
error, or aborted by `close`); a weight update never aborts an in-flight request.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any

from torch import Tensor

from rlsys.config.model import ModelConfig
from rlsys.engine.api import GenerationRequest, GenerationResult
from rlsys.engine.config import EngineConfig
from rlsys.engine.core import EngineCore, EngineStats
from rlsys.engine.runners import make_runner
from rlsys.tokenizer import ByteTokenizer


class InferenceEngine:
    """Continuous-batching engine over the shared model (see module doc)."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        engine_cfg: EngineConfig | None = None,
        state: Mapping[str, Tensor] | None = None,
        version: int = 0,
        tokenizer: ByteTokenizer | None = None,
    ) -> None:
        self.cfg = engine_cfg or EngineConfig()
        runner = make_runner(model_cfg, self.cfg, state)
        self.core = EngineCore(model_cfg, self.cfg, runner, version, tokenizer)
        self._futures: dict[str, Future[GenerationResult]] = {}
        self._commands: list[Callable[[], None]] = []
        self._wake = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="rlsys-engine", daemon=True)
        self._thread.start()

    # ---- public API --------------------------------------------------------------------

    def submit(self, request: GenerationRequest) -> Future[GenerationResult]:
        """Queue a request; the future resolves when it finishes."""
        future: Future[GenerationResult] = Future()

        def add() -> None:
            if request.request_id in self._futures:
                future.set_result(
                    GenerationResult(
                        request.request_id,
                        finish_reason="error",
                        error=f"request_id {request.request_id!r} is already in flight",
                    )
                )
                return
            error = self.core.add(request)
            if error is not None:
                future.set_result(error)
            else:
                self._futures[request.request_id] = future

        self._command(add)
        return future

    def generate(self, request: GenerationRequest) -> GenerationResult:
        """Run one request to completion (blocking; safe from many threads)."""
        return self.submit(request).result()

    def abort(self, request_id: str) -> bool:
        """Abort a request; its `generate` returns finish_reason="abort". False if unknown."""
        return bool(self._call(lambda: self._resolve(self.core.abort(request_id))))

    def update_weights(self, state: Mapping[str, Tensor], version: int) -> None:
        """Load weights as `version` between two steps; blocks until they are in use."""
        self._call(lambda: self.core.update_weights(state, version))

    def stats(self) -> EngineStats:
        return self._call(self.core.stats)

    @property
    def version(self) -> int:
        return self.core.version

    def close(self) -> None:
        """Stop the loop; requests still in flight finish with finish_reason="abort"."""
        with self._wake:
            if self._closed:
                return
            self._closed = True
            self._wake.notify()
        self._thread.join()
        for command in self._commands:  # accepted before close: run, then abort below
            command()
        for seq in [*self.core.running, *self.core.waiting]:
            self._resolve(self.core.abort(seq.request.request_id))
        self.core.runner.close()

    def __enter__(self) -> InferenceEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- scheduler thread --------------------------------------------------------------

    def _command(self, fn: Callable[[], None]) -> None:
        with self._wake:
            if self._closed:
                raise RuntimeError("engine is closed")
            self._commands.append(fn)
            self._wake.notify()

    def _call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the scheduler thread between steps and return its value."""
        done: Future[Any] = Future()

        def run() -> None:
            try:
                done.set_result(fn())
            except Exception as err:
                done.set_exception(err)

        self._command(run)
        return done.result()

    def _resolve(self, result: GenerationResult | None) -> GenerationResult | None:
        if result is not None:
            future = self._futures.pop(result.request_id, None)
            if future is not None:
                future.set_result(result)
        return result

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._commands and not self.core.has_work() and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                commands, self._commands = self._commands, []
            for command in commands:
                command()
            if self.core.has_work():
                for result in self.core.step():
                    self._resolve(result)
