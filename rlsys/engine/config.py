"""Configuration of one inference engine (one replica), importable without torch.

Invariant: nothing here changes a token's numerics. Batch limits, the prefill budget per
step, the prefix-cache capacity, the TP degree and speculative decoding decide only *when*
and *where* a token is computed; the batch-invariant kernels make its log-probs independent
of all of them (a draft is kept only when the seeded sampler draws it).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rlsys.config.model import ModelConfig


class EngineConfig(BaseModel):
    """Limits and layout of one engine replica."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_running: int = Field(16, ge=1, le=4096, description="Sequences batched per step.")
    max_context_tokens: int = Field(
        1024, ge=2, description="Context budget per sequence: prompt + generated tokens."
    )
    max_step_tokens: int = Field(
        512, ge=1, description="Token rows per forward step (decode rows first, then prefill)."
    )
    candidate_cap: int = Field(
        64, ge=1, description="Max recorded candidates per token (requests may ask for fewer)."
    )
    prefix_cache_tokens: int = Field(
        200_000, ge=0, description="Prefix cache capacity in cached tokens (0 = off)."
    )
    tp: Literal[1, 2, 4, 8] = Field(1, description="Tensor-parallel degree.")
    tp_backend: Literal["threads", "gloo", "nccl"] = Field(
        "threads",
        description="TP ranks as threads of this process, as gloo processes (CPU), or as NCCL "
        "processes, one GPU each (torch.distributed).",
    )
    seed: int = Field(0, description="Seeds requests that carry no seed of their own.")
    sample_vocab: int | None = Field(
        None,
        ge=1,
        description="Sample only ids below this (the tokenizer's vocabulary; the model's may be "
        "padded larger). None: the whole model vocabulary. The trainer's `valid_vocab` must match.",
    )
    device: str = Field("cpu", description="Torch device of the model (TP runs on CPU).")
    kv_page_tokens: int = Field(
        64, ge=16, description="Tokens per KV page (the Triton path's paged cache)."
    )
    kv_cache_tokens: int | None = Field(
        None,
        ge=1,
        description="Paged KV capacity in tokens (Triton path). None: max_running x "
        "max_context_tokens + prefix_cache_tokens.",
    )

    cuda_graphs: bool = Field(
        True,
        description="Replay decode-only steps as CUDA graphs (CUDA, paged KV cache, TP=1): "
        "one graph per batch size and context bucket; same bits as eager steps.",
    )
    cuda_graph_capture: Literal["start", "lazy"] = Field(
        "start",
        description="When decode graphs are captured: all of them when the engine starts "
        "(seconds at start-up, no stall later), or each on first use (a 0.2-1.7 s stall "
        "mid-generation the first time a batch size / context bucket comes up).",
    )

    route_gates: Literal["float32", "bfloat16", "none"] = Field(
        "float32",
        description="How recorded routes carry their gates: fp32 (what a bitwise "
        "indices_and_gates replay needs), bf16, or none (indices-only replay recomputes them; "
        "ids alone are a fifth of the bytes).",
    )
    record_selections: bool = Field(
        False,
        description="Record every row's Sparse GQA block selections with its routes, for the "
        "trainer's selection replay (trainer.replay_selections). TP=1 on the CPU reference "
        "path only.",
    )

    @model_validator(mode="after")
    def _check_selections(self) -> EngineConfig:
        if self.record_selections and (self.tp != 1 or self.device != "cpu"):
            raise ValueError("record_selections needs tp=1 and device=cpu (the reference path)")
        return self

    speculative_tokens: int = Field(
        0,
        ge=0,
        le=8,
        description="MTP speculative decoding: tokens the MTP heads draft per step, verified "
        "in one forward (0 = off). At most the model's mtp_depth, and the verify chunk "
        "(k + 1 rows) fits one Sparse GQA block and one SWA tile. Reference caches only "
        "(tp=1, device cpu).",
    )

    @model_validator(mode="after")
    def _speculative_needs_reference_caches(self) -> EngineConfig:
        if self.speculative_tokens and (self.tp != 1 or self.device != "cpu"):
            raise ValueError(
                "speculative_tokens > 0 needs tp=1 and device='cpu': rolling back rejected "
                "drafts is implemented for the reference KV caches only"
            )
        return self

    def check_model(self, model_cfg: ModelConfig) -> None:
        """The model-dependent limit of `speculative_tokens` (raises ValueError)."""
        limit = model_cfg.max_speculative_tokens
        if self.speculative_tokens > limit:
            raise ValueError(
                f"engine.speculative_tokens: {self.speculative_tokens} > {limit}, the most this "
                f"model allows (mtp_depth {model_cfg.mtp_depth}; k + 1 rows must fit one Sparse "
                f"GQA block ({model_cfg.sparse_block}) and one SWA tile ({model_cfg.swa_tile}))"
            )

    def kv_pages(self) -> int:
        """Pages of the paged KV cache (per attention kind)."""
        tokens = self.kv_cache_tokens or (
            self.max_running * self.max_context_tokens + self.prefix_cache_tokens
        )
        # + one page per running sequence (partial pages) + the decode graphs' scratch page
        return -(-tokens // self.kv_page_tokens) + self.max_running + 2

    @classmethod
    def from_job(cls, engine_section: Any, seed: int, **overrides: Any) -> EngineConfig:
        """The engine part of a job config's `engine` section (replica/Ray fields dropped)."""
        return cls(
            max_running=engine_section.max_running,
            max_context_tokens=engine_section.max_context_tokens,
            candidate_cap=engine_section.candidate_cap,
            prefix_cache_tokens=engine_section.prefix_cache_tokens,
            tp=engine_section.tp,
            speculative_tokens=engine_section.speculative_tokens,
            seed=seed,
            # A replica Ray gave a GPU runs its model there (Ray sets CUDA_VISIBLE_DEVICES);
            # with tp > 1, one NCCL rank per GPU it was given.
            device="cuda" if engine_section.num_gpus > 0 else "cpu",
            tp_backend="nccl"
            if engine_section.num_gpus > 0 and engine_section.tp > 1
            else "threads",
            record_selections=engine_section.record_selections,
            route_gates=engine_section.route_gates,
            cuda_graphs=engine_section.cuda_graphs,
            cuda_graph_capture=engine_section.cuda_graph_capture,
            **overrides,
        )
