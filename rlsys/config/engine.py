"""The engine configuration: the job's `engine` section is this class, and so is what one
engine replica runs with (pydantic only, importable without torch).

Invariants:
- One class. The job schema holds it as `JobConfig.engine`; a replica gets the same object
  (its `seed` made the job's, its `sample_vocab` the tokenizer's: `rlsys.engine.backends`).
- Where Ray puts a replica (`EnginePlacement`) is a sub-model: nothing in it reaches the
  engine except through `device` and `tp_backend`, which follow it unless given.
  A job config may write the placement keys flat (`engine.replicas`) or nested
  (`engine.placement.replicas`); errors name the nested path.
- Nothing here changes a token's numerics. Batch limits, the prefill budget per step, the
  prefix-cache capacity, the TP degree and speculative decoding decide only *when* and
  *where* a token is computed; the batch-invariant kernels make its log-probs independent
  of all of them (a draft is kept only when the seeded sampler draws it).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rlsys.config.model import ModelConfig


class EnginePlacement(BaseModel):
    """Where Ray places the replica actors, and how many there are."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    replicas: int = Field(2, ge=1, le=64, description="Engine replica actors.")
    num_cpus: float = Field(0.5, ge=0, description="Ray CPUs per replica actor.")
    num_gpus: float = Field(
        0.0,
        ge=0,
        description="Ray GPUs per replica actor; > 0 runs its model on CUDA (tp > 1: one "
        "NCCL rank per GPU).",
    )
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources per replica actor; it is placed on a node "
        "that offers them.",
    )


PLACEMENT_KEYS = frozenset(EnginePlacement.model_fields)


def _nest_placement(data: dict[str, Any]) -> dict[str, Any]:
    """Flat placement keys (`replicas: 2`) moved into `placement`; both at once is refused."""
    flat = {k: data[k] for k in PLACEMENT_KEYS & set(data)}
    if not flat:
        return data
    nested = data.get("placement")
    if isinstance(nested, EnginePlacement):
        nested = nested.model_dump(exclude_unset=True)
    nested = dict(nested or {})
    twice = sorted(set(flat) & set(nested))
    if twice:
        raise ValueError(
            f"{', '.join(f'engine.{k} and engine.placement.{k}' for k in twice)}: "
            "both given; write one"
        )
    rest = {k: v for k, v in data.items() if k not in PLACEMENT_KEYS}
    return {**rest, "placement": {**nested, **flat}}


def _gpus_of(placement: Any) -> float:
    if isinstance(placement, EnginePlacement):
        return placement.num_gpus
    try:
        return float((placement or {}).get("num_gpus", 0.0))
    except (TypeError, ValueError):
        return 0.0  # the field's own validation reports it


class EngineConfig(BaseModel):
    """The engine: its backend, batch limits, layout, recording and weight transport."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: Literal["native", "vllm"] = Field(
        "native",
        description="native: our engine (bitwise aligned with the trainer); vllm: vLLM's "
        "offline engine on a Hugging Face model (model.kind hf; mismatch measured, not "
        "bitwise; needs the rlsys[vllm] extra).",
    )
    placement: EnginePlacement = Field(
        default_factory=EnginePlacement,
        description="Ray placement of the replicas (its keys may also be written flat).",
    )
    max_running: int = Field(16, ge=1, le=4096, description="Sequences a replica batches per step.")
    max_queue: int = Field(64, ge=0, le=100_000, description="Requests that may wait per replica.")
    max_context_tokens: int = Field(
        1024, ge=2, description="Context budget per sequence: prompt + generated tokens."
    )
    max_step_tokens: int = Field(
        512, ge=1, description="Token rows per forward step (decode rows first, then prefill)."
    )
    candidate_cap: int = Field(
        64,
        ge=1,
        description="Memory cap on a token's recorded top-p candidate set: the engine samples "
        "from the true nucleus (sampling.top_p), and a nucleus larger than this is cut to its "
        "most probable tokens for sampling and replay alike (the monitor shows set sizes).",
    )
    prefix_cache_tokens: int = Field(
        200_000, ge=0, description="Prefix cache capacity in cached tokens (0 = off)."
    )
    tp: Literal[1, 2, 4, 8] = Field(1, description="Tensor-parallel degree of each replica.")
    tp_backend: Literal["threads", "gloo", "nccl"] = Field(
        "threads",
        description="TP ranks as threads of this process, as gloo processes (CPU), or as NCCL "
        "processes, one GPU each (torch.distributed). Unset: nccl for a GPU replica with "
        "tp > 1, else threads.",
    )
    seed: int = Field(
        0, description="Seeds requests that carry no seed of their own (in a job: its `seed`)."
    )
    sample_vocab: int | None = Field(
        None,
        ge=1,
        description="Sample only ids below this (the tokenizer's vocabulary; the model's may be "
        "padded larger). None: the whole model vocabulary. The trainer's `valid_vocab` must match.",
    )
    device: str = Field(
        "cpu",
        description="Torch device of the model (TP runs on CPU). Unset: cuda when "
        "placement.num_gpus > 0, else cpu.",
    )
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
    overlap_decode: bool = Field(
        True,
        description="Queue each decode step on the device behind the previous one, fed the "
        "tokens it drew there, before the host has read them: the host's scheduling, "
        "records and stop checks run while the GPU computes (decode graphs with on-device "
        "sampling). Same tokens and records; a sequence that stops has one row computed "
        "and discarded.",
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
        "trainer.replay_experts indices_and_gates needs), bf16, or none (indices-only replay "
        "recomputes them; ids alone are a fifth of the bytes). In a job, left out: float32 "
        "with trainer.replay_experts indices_and_gates, else none.",
    )
    record_selections: bool = Field(
        False,
        description="Record every row's Sparse GQA block selections with its routes, for the "
        "trainer's selection replay (trainer.replay_selections). TP=1 on the CPU reference "
        "path only.",
    )
    speculative_tokens: int = Field(
        0,
        ge=0,
        le=8,
        description="MTP speculative decoding: tokens the MTP heads draft per step, verified "
        "in one forward (0 = off). At most the model's max_speculative_tokens (mtp_depth; "
        "k + 1 rows fit one Sparse GQA block and one SWA tile). Reference caches only "
        "(tp=1, device cpu). Tokens are unchanged.",
    )
    weight_transport: Literal["object_store", "collective"] = Field(
        "object_store",
        description="How new weights reach the replicas: the Ray object store, or a "
        "torch.distributed broadcast from the trainer (NCCL between GPUs, gloo on CPUs).",
    )
    weight_sync_timeout_s: float = Field(
        60.0, gt=0, description="Bound on one weight publication before a replica is dropped."
    )

    @model_validator(mode="before")
    @classmethod
    def _placement_and_device(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = _nest_placement(data)
        gpus = _gpus_of(data.get("placement"))
        # A replica Ray gave a GPU runs its model there (Ray sets CUDA_VISIBLE_DEVICES);
        # with tp > 1, one NCCL rank per GPU it was given.
        if "device" not in data:
            data["device"] = "cuda" if gpus > 0 else "cpu"
        if "tp_backend" not in data:
            data["tp_backend"] = "nccl" if gpus > 0 and data.get("tp", 1) != 1 else "threads"
        return data

    @model_validator(mode="after")
    def _reference_path_only(self) -> EngineConfig:
        on_reference = self.tp == 1 and self.device == "cpu"
        if self.record_selections and not on_reference:
            raise ValueError(
                "engine.record_selections needs tp 1 on the CPU (device cpu, "
                "placement.num_gpus 0): the reference path"
            )
        if self.speculative_tokens and not on_reference:
            raise ValueError(
                "engine.speculative_tokens > 0 needs tp 1 on the CPU (device cpu, "
                "placement.num_gpus 0): rolling back rejected drafts is implemented for the "
                "reference KV caches only"
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

    def copy_with(self, **updates: Any) -> EngineConfig:
        """A copy with `updates`, validated (unlike `model_copy`)."""
        return type(self).model_validate({**self.model_dump(exclude_unset=True), **updates})
