"""Model configuration: the deep Sparse GQA MoE policy model, and its presets.

Invariants:
- Importable without torch (pydantic only), so `rlsys model info --help` and config
  validation answer fast and the ledger side can read a stored job config.
- Layer `i` is a Sparse GQA layer iff `(i + 1) % (swa_per_sparse + 1) == 0`; every other
  layer is gated sliding-window attention (3:1 for the default `swa_per_sparse=3`).
- Everything a kernel's *shape* depends on (tiles, blocks, window) is fixed here, never
  derived from a batch, so a token's computation is the same in any batch
  (docs/ARCHITECTURE.md, "Numerics").
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

LayerKind = Literal["swa", "sparse"]

_DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2}


class ModelConfig(BaseModel):
    """Shape and numerics of the policy model. Presets: `tiny`, `small`, `deep-92`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    vocab_size: int = Field(ge=2, description="Vocabulary size (byte-level tokens + specials).")
    d_model: int = Field(ge=8, description="Width of the fp32 residual stream.")
    n_layers: int = Field(ge=1, description="Number of transformer blocks (depth).")
    n_heads: int = Field(ge=1, description="Query heads per attention layer.")
    n_kv_groups: int = Field(ge=1, description="KV groups (GQA); must divide n_heads.")
    head_dim: int = Field(ge=2, description="Per-head dimension (even, for rotary).")
    swa_per_sparse: int = Field(3, ge=0, description="SWA layers per Sparse GQA layer (3 = 3:1).")
    swa_window: int = Field(ge=1, description="Sliding window W: a query sees keys (t-W, t].")
    swa_tile: int = Field(
        ge=1, description="SWA query tile and key block (aligned to absolute positions)."
    )
    sparse_block: int = Field(ge=1, description="Sparse GQA block size B (index keys merged).")
    sparse_topk: int = Field(ge=1, description="Sparse GQA selected tokens k (k/B past blocks).")
    sparse_query_tile: int = Field(
        ge=1, description="Adjacent queries attended as one tile over their union (multiple of B)."
    )
    tiles_per_chunk: int = Field(
        64,
        ge=1,
        description="Query tiles attended at once (checkpointed when training): memory O(chunk*k).",
    )
    index_dim: int = Field(ge=2, description="Dimension of index queries / keys (rotary, even).")
    n_experts: int = Field(ge=1, le=32767, description="Routed experts per MoE layer.")
    experts_per_token: int = Field(ge=1, description="Top-k routed experts per token.")
    n_shared_experts: int = Field(0, ge=0, description="Always-on shared experts.")
    expert_hidden: int = Field(ge=1, description="Hidden width of each (SwiGLU) expert.")
    balance: Literal["bias", "aux_loss"] = Field(
        "bias", description="Load balancing: selection bias (aux-loss free) or auxiliary loss."
    )
    balance_bias_rate: float = Field(1e-3, ge=0, description="Bias step per balance update.")
    aux_loss_weight: float = Field(1e-2, ge=0, description="Weight of the balance aux loss.")
    mtp_depth: int = Field(0, ge=0, description="MTP heads predicting t+2 .. t+1+D.")
    rope_theta: float = Field(10000.0, gt=0, description="Rotary base.")
    norm_eps: float = Field(1e-6, gt=0, description="RMSNorm epsilon.")
    grad_clamp_fraction: float = Field(
        4e-7, ge=0, le=1, description="Fraction of largest-norm residual grad vectors clipped."
    )
    compute_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Dtype of block weights/compute; residual stream stays fp32."
    )
    init_std: float = Field(0.02, gt=0, description="Std of the normal weight init.")

    @model_validator(mode="after")
    def _check_shapes(self) -> ModelConfig:
        if self.n_heads % self.n_kv_groups:
            raise ValueError("n_heads must be a multiple of n_kv_groups")
        if self.head_dim % 2 or self.index_dim % 2:
            raise ValueError("head_dim and index_dim must be even (rotary embedding)")
        if self.sparse_topk % self.sparse_block:
            raise ValueError("sparse_topk must be a multiple of sparse_block")
        if self.sparse_query_tile % self.sparse_block:
            raise ValueError("sparse_query_tile must be a multiple of sparse_block")
        if self.experts_per_token > self.n_experts:
            raise ValueError("experts_per_token must be <= n_experts")
        # Row-parallel reductions always run as 8 fixed chunks (rlsys.kernels.tp.SPLITS), at
        # every TP degree, TP=1 included: that is what makes log-probs TP-invariant.
        if (self.n_heads * self.head_dim) % 8 or self.expert_hidden % 8:
            raise ValueError("n_heads * head_dim and expert_hidden must be multiples of 8")
        return self

    # ---- derived shape facts (torch-free) -------------------------------------------------

    def layer_kinds(self) -> list[LayerKind]:
        """Attention kind of every block, in order."""
        period = self.swa_per_sparse + 1
        return ["sparse" if (i + 1) % period == 0 else "swa" for i in range(self.n_layers)]

    @property
    def max_speculative_tokens(self) -> int:
        """Most drafts one engine verify step can take: one MTP head per draft, and the
        verify chunk (drafts + 1 rows) within one Sparse GQA block and one SWA tile, so a
        rollback crosses at most one block boundary (`rlsys.model.cache_rollback`)."""
        return min(self.mtp_depth, min(self.sparse_block, self.swa_tile) - 1)

    @property
    def swa_blocks_per_tile(self) -> int:
        """Key blocks a SWA query tile reads: the window's blocks plus its own."""
        return math.ceil(max(self.swa_window - 1, 0) / self.swa_tile) + 1

    @property
    def sparse_selected_blocks(self) -> int:
        """Past blocks each KV group selects per query (k / B)."""
        return self.sparse_topk // self.sparse_block

    def kv_cache_bytes_per_token(self) -> int:
        """Bytes the cache grows per token: Sparse GQA layers keep full K/V + block index keys.

        Index keys are kept in fp32 (they decide the top-k selection, so they are not rounded).
        """
        n_sparse = self.layer_kinds().count("sparse")
        kv = 2 * self.n_kv_groups * self.head_dim * _DTYPE_BYTES[self.compute_dtype]
        index_key = self.index_dim * 4 / self.sparse_block
        return int(math.ceil(n_sparse * (kv + index_key)))

    def swa_cache_bytes_per_sequence(self) -> int:
        """Bytes the window-bounded SWA caches hold per sequence (independent of length)."""
        n_swa = self.layer_kinds().count("swa")
        kv = 2 * self.n_kv_groups * self.head_dim * _DTYPE_BYTES[self.compute_dtype]
        return n_swa * kv * self.swa_blocks_per_tile * self.swa_tile

    def expert_index_dtype(self) -> Literal["uint8", "int16"]:
        """Compact dtype of a recorded expert id."""
        return "uint8" if self.n_experts <= 256 else "int16"

    def routing_record_bytes_per_token(self) -> int:
        """Bytes of one token's routing record: every MoE layer's ids + exact fp32 gates."""
        id_bytes = 1 if self.expert_index_dtype() == "uint8" else 2
        return self.n_layers * self.experts_per_token * (id_bytes + 4)

    def selection_record_bytes_per_token(self) -> int:
        """Bytes of one row's Sparse GQA selections as recorded (engine.record_selections):
        k / B int16 block ids per Sparse GQA layer and KV group (rows before the
        (k / B + 1)-th block select fewer)."""
        n_sparse = self.layer_kinds().count("sparse")
        return n_sparse * self.n_kv_groups * self.sparse_selected_blocks * 2

    def with_overrides(self, overrides: dict[str, Any]) -> ModelConfig:
        """A validated copy with `overrides` applied (unknown keys are rejected)."""
        return ModelConfig.model_validate({**self.model_dump(), **overrides})


PRESETS: dict[str, ModelConfig] = {
    # Unit tests: every code path (SWA, Sparse GQA, MoE, MTP) in well under a second.
    "tiny": ModelConfig(
        vocab_size=64,
        d_model=32,
        n_layers=4,
        n_heads=4,
        n_kv_groups=2,
        head_dim=8,
        swa_window=12,
        swa_tile=4,
        sparse_block=2,
        sparse_topk=8,
        sparse_query_tile=4,
        index_dim=8,
        n_experts=4,
        experts_per_token=2,
        n_shared_experts=1,
        expert_hidden=32,
        mtp_depth=1,
    ),
    # Learns the quickstart tool-use task on a 2-core CPU: byte-level vocab, ~4M params.
    "small": ModelConfig(
        vocab_size=320,
        d_model=128,
        n_layers=8,
        n_heads=4,
        n_kv_groups=2,
        head_dim=32,
        swa_window=128,
        swa_tile=16,
        sparse_block=8,
        sparse_topk=256,
        sparse_query_tile=8,
        index_dim=32,
        n_experts=8,
        experts_per_token=2,
        n_shared_experts=1,
        expert_hidden=128,
        mtp_depth=1,
    ),
    # One GPU per replica and for the trainer (configs/gpu-example.yaml): byte-level vocab,
    # ~110M parameters in bf16, deep enough (24 blocks: 18 SWA, 6 Sparse GQA) that the
    # 3:1 interleave and expert routing matter, small enough to train at tens of steps a
    # minute on one H200.
    "medium": ModelConfig(
        vocab_size=320,
        d_model=512,
        n_layers=24,
        n_heads=8,
        n_kv_groups=2,
        head_dim=64,
        swa_window=256,
        swa_tile=32,
        sparse_block=8,
        sparse_topk=512,
        sparse_query_tile=32,
        index_dim=32,
        n_experts=16,
        experts_per_token=2,
        n_shared_experts=1,
        expert_hidden=256,
        mtp_depth=1,
        compute_dtype="bfloat16",
    ),
    # The GPU job at real depth: narrow and deep like the reference shape
    # (48 blocks, 3:1 SWA : Sparse GQA, B=8, k=4096) with a byte-level vocabulary, sized so
    # that one H200 holds its bf16 weights, fp32 master copy and Adam state with room for
    # 32K-token sequences: `rlsys model info large` prints its total and active
    # parameters.
    "large": ModelConfig(
        vocab_size=320,
        d_model=1024,
        n_layers=48,
        n_heads=16,
        n_kv_groups=4,
        head_dim=64,
        swa_window=512,
        swa_tile=64,
        sparse_block=8,
        sparse_topk=4096,
        sparse_query_tile=64,
        index_dim=64,
        n_experts=32,
        experts_per_token=4,
        n_shared_experts=1,
        expert_hidden=512,
        mtp_depth=1,
        compute_dtype="bfloat16",
    ),
    # The narrow-but-deep reference shape: 92 blocks, 3:1 SWA:Sparse GQA, B=8, k=4096.
    "deep-92": ModelConfig(
        vocab_size=128000,
        d_model=2048,
        n_layers=92,
        n_heads=16,
        n_kv_groups=4,
        head_dim=128,
        swa_window=512,
        swa_tile=64,
        sparse_block=8,
        sparse_topk=4096,
        sparse_query_tile=64,
        index_dim=64,
        n_experts=64,
        experts_per_token=6,
        n_shared_experts=1,
        expert_hidden=768,
        mtp_depth=3,
        compute_dtype="bfloat16",
    ),
}


def preset(name: str) -> ModelConfig:
    """The named preset; `KeyError` lists the known names."""
    if name not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]
