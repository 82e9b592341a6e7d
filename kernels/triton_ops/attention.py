"""Attention entry points for the model: a differentiable packed forward (training) and
the forward used by the engine over its paged pools (inference, no autograd).

Both run the same forward kernel (`attention_fwd`); see its module doc for why a token's
output is the same in either. `PackedAttention.backward` runs the Triton backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from rlsys.kernels.attention_plan import PagedKV, QueryTiles
from rlsys.kernels.triton_ops.attention_bwd import attention_backward, block_mass
from rlsys.kernels.triton_ops.attention_fwd import attention_forward


@dataclass(frozen=True)
class AttentionShape:
    """What a call needs besides tensors: softmax scale, key step, SWA window / Sparse GQA.

    `sparse` = (step_off, step_ids, sel_bits) from the indexer; None means SWA.
    """

    scale: float
    step: int
    window: int = 0
    sparse: tuple[Tensor, Tensor, Tensor] | None = None
    block: int = 1

    def kwargs(self) -> dict[str, Any]:
        return {
            "scale": self.scale,
            "step": self.step,
            "window": self.window,
            "sparse": self.sparse,
            "block": self.block,
        }


class PackedAttention(torch.autograd.Function):
    """Training: q (N, H, D), k/v (N, Hkv, D) of sequences packed from position 0."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        tiles: QueryTiles,
        kv: PagedKV,
        seq_lens: list[int],
        shape: AttentionShape,
    ) -> tuple[Tensor, Tensor]:
        out, lse = attention_forward(q, k, v, tiles, kv, **shape.kwargs())
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.meta = (tiles, kv, seq_lens, shape)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx: Any, do: Tensor, _dlse: Tensor) -> tuple:  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        tiles, kv, seq_lens, shape = ctx.meta
        dq, dk, dv = attention_backward(
            do, q, k, v, out, lse, tiles, kv, seq_lens, **shape.kwargs()
        )
        return dq, dk, dv, None, None, None, None


def packed_attention(
    q: Tensor, k: Tensor, v: Tensor, tiles: QueryTiles, kv: PagedKV, seq_lens: list[int],
    shape: AttentionShape,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(out, lse) with autograd through q, k, v."""
    return PackedAttention.apply(q, k, v, tiles, kv, seq_lens, shape)


def paged_attention(
    q: Tensor, k_pool: Tensor, v_pool: Tensor, tiles: QueryTiles, kv: PagedKV,
    shape: AttentionShape, gate: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """Inference over the engine's pools (no autograd); `gate` (N, H): the output gate
    applied in the kernel's epilogue (bitwise `out * gate[..., None]`)."""
    return attention_forward(q, k_pool, v_pool, tiles, kv, **shape.kwargs(), gate=gate)[0]


def selected_block_mass(
    q: Tensor, k: Tensor, lse: Tensor, tiles: QueryTiles, kv: PagedKV, shape: AttentionShape,
    topk_blocks: int,
) -> Tensor:  # fmt: skip
    """Detached (N, Hkv, KSEL) mass of the main attention on each selected block."""
    assert shape.sparse is not None
    with torch.no_grad():
        return block_mass(
            q, k, lse, tiles, kv, shape.sparse, topk_blocks,
            scale=shape.scale, step=shape.step, block=shape.block,
        )  # fmt: skip
