"""`InferenceEngine`: the thread-safe facade the replica actor wraps.

Many threads call `generate` at once; one scheduler thread owns the `EngineCore` and runs
steps while there is work, so requests join and leave the batch at every step. Commands
(add, abort, weight update) are queued and applied between steps, never during one
(`command_queue.py`, shared with the vLLM backend).

Invariants: every accepted `generate` call returns exactly one result (finished, aborted,
error, or aborted by `close`); a weight update never aborts an in-flight request.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from concurrent.futures import Future

from torch import Tensor

from rlsys.config.engine import EngineConfig
from rlsys.config.model import ModelConfig
from rlsys.engine.api import GenerationRequest, GenerationResult
from rlsys.engine.command_queue import CommandQueue
from rlsys.engine.core import EngineCore
from rlsys.engine.runners import make_runner
from rlsys.engine.stats import EngineStats
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
        self._queue = CommandQueue()
        self._thread = threading.Thread(
            target=self._queue.serve,
            args=(self.core.has_work, self._step),
            name="rlsys-engine",
            daemon=True,
        )
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

        self._queue.submit(add)
        return future

    def generate(self, request: GenerationRequest) -> GenerationResult:
        """Run one request to completion (blocking; safe from many threads)."""
        return self.submit(request).result()

    def abort(self, request_id: str) -> bool:
        """Abort a request; its `generate` returns finish_reason="abort". False if unknown."""
        return bool(self._queue.call(lambda: self._resolve(self.core.abort(request_id))))

    def update_weights(self, state: Mapping[str, Tensor], version: int) -> None:
        """Load weights as `version` between two steps; blocks until they are in use."""
        self._queue.call(lambda: self.core.update_weights(state, version))

    def stats(self) -> EngineStats:
        return self._queue.call(self.core.stats)

    @property
    def version(self) -> int:
        return self.core.version

    def close(self) -> None:
        """Stop the loop; requests still in flight finish with finish_reason="abort"."""
        if not self._queue.close(self._thread):  # runs the commands accepted before it
            return
        for seq in [*self.core.running, *self.core.waiting]:
            self._resolve(self.core.abort(seq.request.request_id))
        self.core.runner.close()

    def __enter__(self) -> InferenceEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- scheduler thread --------------------------------------------------------------

    def _resolve(self, result: GenerationResult | None) -> GenerationResult | None:
        if result is not None:
            future = self._futures.pop(result.request_id, None)
            if future is not None:
                future.set_result(result)
        return result

    def _step(self) -> None:
        for result in self.core.step():
            self._resolve(result)
