"""`VllmEngine`: vLLM's offline engine behind the same thread-safe `generate` as ours.

A Hugging Face causal LM from a local directory runs in vLLM's `LLMEngine` (V1, in this
process: `VLLM_ENABLE_V1_MULTIPROCESSING=0`, so new weights reach the model by a direct
`reload_weights`), with `skip_tokenizer_init=True` (token ids in and out; the task's own
tokenizer owns the text), prefix caching on and continuous batching. One scheduler
thread owns the `LLMEngine`; `generate` may be called from many threads. Commands (add,
weight update) run between two `step()`s, never during one (`command_queue.py`).

Per generated token the result holds what the native engine's does: the id, its
log-prob (vLLM's processed log-prob: after temperature and top-p), the policy version of
the weights that produced it, and the top-p candidate set from `logprobs=candidate_cap`
(exact when the nucleus fits, else flagged `capped`: `vllm_records.py`). Only ids below
`sample_vocab` are sampled (the tokenizer's; a model's vocabulary may be padded larger). No
routed experts: vLLM returns them only on GPUs today, so `routed_experts` stays None and the
trainer routes with its own router (its R3 hook, `rlsys.model.hf_routing`, has nothing to
replay from this backend yet).

Invariants: every accepted `generate` returns exactly one result; a weight update never
aborts an in-flight request: vLLM preempts it (`reset_prefix_cache(reset_running_requests=
True)`), drops every cached block, and resumes it by recomputing its context under the new
weights, as the native engine does; its later tokens carry the new version. No request
reuses a KV block of an older version.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import Tensor

from rlsys.config.engine import EngineConfig
from rlsys.engine.api import FinishReason, GenerationRequest, GenerationResult
from rlsys.engine.command_queue import CommandQueue
from rlsys.engine.stats import EngineStats
from rlsys.engine.validation import request_error
from rlsys.engine.vllm_records import token_record
from rlsys.tokenizer import ByteTokenizer


@dataclass
class _Pending:
    request: GenerationRequest
    future: Future[GenerationResult]
    stops: list[list[int]]
    result: GenerationResult = field(init=False)

    def __post_init__(self) -> None:
        self.result = GenerationResult(
            self.request.request_id, prompt_tokens=len(self.request.prompt_ids)
        )


def _prepack_cpu_moe(model: Any) -> int:
    """Re-run the CPU MoE experts' weight prepacking after a reload; returns the layers.

    vLLM 0.32's reload copies new expert weights into the fused-MoE parameters in their
    loaded layout, but prepacks them for the CPU grouped GEMM only on the first load, so
    the kernel then reads unpacked weights as packed ones (measured: reloading *identical*
    weights moved a tiny Qwen3-MoE's log-probs by up to 0.57). Prepacking again restores
    them (0.0 difference). A no-op for dense models and for non-CPU kernels without this
    hook (`process_weights_after_loading` of the experts' kernel)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    layers = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        if kernel is not None:
            kernel.fused_experts.process_weights_after_loading(module)
            layers += 1
    return layers


def _hf_config(model_path: str) -> dict[str, Any]:
    return json.loads((Path(model_path) / "config.json").read_text())


def kv_cache_bytes(model_path: str, engine_cfg: EngineConfig) -> int:
    """vLLM's KV budget: `kv_cache_tokens` (else max_running x max_context_tokens +
    prefix_cache_tokens) tokens of fp32 K and V in every layer of the model."""
    hf = _hf_config(model_path)
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads") or hf["num_attention_heads"]
    per_token = hf["num_hidden_layers"] * 2 * kv_heads * head_dim * 4
    tokens = engine_cfg.kv_cache_tokens or (
        engine_cfg.max_running * engine_cfg.max_context_tokens + engine_cfg.prefix_cache_tokens
    )
    return tokens * per_token


class VllmEngine:
    """Continuous batching by vLLM (see module doc)."""

    def __init__(
        self, model_path: str, engine_cfg: EngineConfig, version: int = 0, dtype: str = "float32"
    ) -> None:
        # In-process engine core: weights are loaded by a direct call on the worker. Must be
        # set before vLLM reads its environment (on first use, in this constructor).
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import EngineArgs, LLMEngine

        self.cfg, self.version = engine_cfg, version
        self.llm = LLMEngine.from_engine_args(
            EngineArgs(
                model=model_path,
                skip_tokenizer_init=True,
                enable_prefix_caching=engine_cfg.prefix_cache_tokens > 0,
                max_model_len=engine_cfg.max_context_tokens,
                max_num_seqs=engine_cfg.max_running,
                max_num_batched_tokens=max(
                    engine_cfg.max_step_tokens, engine_cfg.max_context_tokens
                ),
                max_logprobs=engine_cfg.candidate_cap,
                logprobs_mode="processed_logprobs",
                dtype=dtype,  # the job runs fp32 (the trainer's dtype); benchmarks try bf16
                seed=engine_cfg.seed,
                block_size=engine_cfg.kv_page_tokens,  # vLLM's CPU default, 128, rarely hits
                enforce_eager=True,  # no torch.compile: start-up in seconds, not minutes
                kv_cache_memory_bytes=kv_cache_bytes(model_path, engine_cfg),
            )
        )
        self.tokenizer = ByteTokenizer()
        self.vocab_size = int(_hf_config(model_path)["vocab_size"])
        # sample only the tokenizer's ids (`sample_vocab`), as the native engine and the
        # trainer's `valid_vocab`: vLLM masks the rest before temperature and top-p
        limit = engine_cfg.sample_vocab
        self.allowed = list(range(limit)) if limit and limit < self.vocab_size else None
        self._pending: dict[str, _Pending] = {}
        self._queue = CommandQueue()
        self.steps = self.generated_tokens = self.prompt_tokens = self.hit_tokens = 0
        self._busy_s = 0.0
        self._thread = threading.Thread(
            target=self._queue.serve,
            args=(lambda: bool(self._pending), self._step),
            name="rlsys-vllm",
            daemon=True,
        )
        self._thread.start()

    # ---- public API --------------------------------------------------------------------

    def generate(self, request: GenerationRequest) -> GenerationResult:
        """Run one request to completion (blocking; safe from many threads)."""
        future: Future[GenerationResult] = Future()
        self._queue.submit(lambda: self._add(request, future))
        return future.result()

    def update_weights(self, state: Mapping[str, Tensor], version: int) -> None:
        """Load HF-named weights as `version` between two steps; blocks until in use."""
        tensors = dict(state)

        def load() -> None:
            # vLLM's in-place reload: loads checkpoint-format tensors and re-runs each layer's
            # post-load processing (the CPU build repacks linear weights after loading)
            self.llm.collective_rpc(
                "reload_weights", kwargs={"weights_iterator": list(tensors.items())}
            )
            self.llm.apply_model(_prepack_cpu_moe)
            self.llm.reset_prefix_cache(reset_running_requests=True)
            self.version = version

        self._queue.call(load)

    def stats(self) -> EngineStats:
        return self._queue.call(self._stats)

    def close(self) -> None:
        if not self._queue.close(self._thread):  # runs the commands accepted before it
            return
        for pending in list(self._pending.values()):
            self._finish(pending, "abort")
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        # vLLM's in-process engine keeps process-wide parallel state: release it, so the
        # process can host a later engine (one VllmEngine per process at a time)
        self.llm.engine_core.shutdown()
        cleanup_dist_env_and_memory()

    # ---- scheduler thread --------------------------------------------------------------

    def _add(self, request: GenerationRequest, future: Future[GenerationResult]) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        s, room = request.sampling, self.cfg.max_context_tokens - len(request.prompt_ids)
        error = request_error(request, self.vocab_size, self.cfg.max_context_tokens)
        if error is None and request.request_id in self._pending:
            error = f"request_id {request.request_id!r} is already in flight"
        if error is not None:
            future.set_result(GenerationResult(request.request_id, finish_reason="error",
                                               error=error))  # fmt: skip
            return
        params = SamplingParams(
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k if s.top_k > 0 else -1,
            max_tokens=min(s.max_tokens_per_turn, room),
            stop_token_ids=list(request.stop_token_ids),
            seed=request.seed,
            logprobs=self.cfg.candidate_cap,
            detokenize=False,
            allowed_token_ids=self.allowed,
            output_kind=RequestOutputKind.DELTA,
        )
        stops = [self.tokenizer.encode(text) for text in request.stop_strings]
        pending = _Pending(request, future, stops)
        self._pending[request.request_id] = pending
        try:
            self.llm.add_request(
                request.request_id, {"prompt_token_ids": list(request.prompt_ids)}, params
            )
        except Exception as err:  # vLLM refused it: this request fails, the engine serves on
            pending.result.error = f"vllm refused the request: {err!r}"
            self._finish(pending, "error")

    def _absorb(self, out: Any) -> None:
        pending = self._pending.get(out.request_id)
        if pending is None:
            return
        res, completion = pending.result, out.outputs[0]
        if out.num_cached_tokens is not None and not res.token_ids:
            res.prefix_cache_hit_tokens = int(out.num_cached_tokens)
        for tok, logprobs in zip(completion.token_ids, completion.logprobs or [], strict=True):
            rec = token_record(tok, {i: lp.logprob for i, lp in logprobs.items()})
            res.token_ids.append(rec.token_id)
            res.logprobs.append(rec.logprob)
            res.versions.append(self.version)
            res.candidate_ids.append(rec.candidates)
            res.candidate_capped.append(rec.capped)
            self.generated_tokens += 1
            gen = res.token_ids
            if any(len(s) <= len(gen) and gen[-len(s) :] == s for s in pending.stops):
                if not out.finished:
                    self.llm.abort_request([out.request_id])
                self._finish(pending, "stop")
                return
        if out.finished:
            self._finish(pending, "length" if completion.finish_reason == "length" else "stop")

    def _finish(self, pending: _Pending, reason: FinishReason) -> None:
        del self._pending[pending.request.request_id]
        pending.result.finish_reason = reason
        self.prompt_tokens += pending.result.prompt_tokens
        self.hit_tokens += pending.result.prefix_cache_hit_tokens
        pending.future.set_result(pending.result)

    def _step(self) -> None:
        started = time.perf_counter()
        try:
            outputs = self.llm.step()
        except Exception as err:  # a failed step fails the requests in flight
            self._fail_all(f"vllm step failed: {err!r}")
            return
        for out in outputs:
            self._absorb(out)
        self.steps += 1
        self._busy_s += time.perf_counter() - started

    def _fail_all(self, error: str) -> None:
        self.llm.abort_request(list(self._pending))
        for pending in list(self._pending.values()):
            pending.result.error = error
            self._finish(pending, "error")

    def _stats(self) -> EngineStats:
        return EngineStats(
            version=self.version,
            running=len(self._pending),
            waiting=0,
            steps=self.steps,
            generated_tokens=self.generated_tokens,
            forward_rows=0,
            tokens_per_s=self.generated_tokens / self._busy_s if self._busy_s else 0.0,
            prompt_tokens=self.prompt_tokens,
            prefix_cache_hit_tokens=self.hit_tokens,
            prefix_cache_hit_rate=self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0,
            prefix_cache_entries=0,
            draft_tokens=0,  # vLLM's own speculative decoding is not used
            accepted_draft_tokens=0,
        )
