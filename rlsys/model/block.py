"""One transformer block: norm -> attention -> residual add, norm -> FFN -> residual add.

Invariant (fp32 residual stream): `h` enters and leaves in fp32, and so does its gradient;
only the branch inputs are cast to the compute dtype, and branch outputs are added in fp32.
The gradient clamp sits on the block output. The norms, the residual adds and the casts
run fused at inference (`rlsys.kernels.fused`), bitwise the unfused training forward.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from rlsys.config.model import LayerKind, ModelConfig
from rlsys.kernels import fused
from rlsys.model.attention import SeqSpan
from rlsys.model.aux import AuxLosses
from rlsys.model.cache import LayerCache
from rlsys.model.grad_clamp import GradClamp
from rlsys.model.kv_layout import TritonKV
from rlsys.model.moe import MoE, SwiGLU
from rlsys.model.norm import ZeroCenteredRMSNorm
from rlsys.model.routing import Routing
from rlsys.model.sparse_gqa import SparseGQA
from rlsys.model.swa import GatedSlidingWindowAttention

ATTENTION_KINDS: dict[LayerKind, type[GatedSlidingWindowAttention] | type[SparseGQA]] = {
    "swa": GatedSlidingWindowAttention,
    "sparse": SparseGQA,
}


class Block(nn.Module):
    """A block with an MoE FFN (`moe_layer` = its routing-record index) or a dense SwiGLU."""

    def __init__(
        self, cfg: ModelConfig, kind: LayerKind, moe_layer: int | None, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.kind, self.dtype = kind, dtype
        self.attn_norm = ZeroCenteredRMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = ATTENTION_KINDS[kind](cfg, dtype)
        self.ffn_norm = ZeroCenteredRMSNorm(cfg.d_model, cfg.norm_eps)
        out_std = cfg.init_std / (2 * cfg.n_layers) ** 0.5
        self.ffn: MoE | SwiGLU = (
            MoE(cfg, moe_layer, dtype)
            if moe_layer is not None
            else SwiGLU(cfg.d_model, cfg.expert_hidden, cfg.init_std, out_std, dtype)
        )
        self.clamp = GradClamp(cfg.grad_clamp_fraction)

    def refresh_fused(self) -> None:
        """Bring this block's cached weight concatenations up to date with its parameters
        (before a CUDA-graph replay, which reads the buffers it captured)."""
        self.attn.refresh_fused()
        self.ffn.refresh_fused()

    def forward(
        self,
        h: Tensor | fused.CombineInputs,
        positions: Tensor,
        spans: list[SeqSpan],
        caches: list[LayerCache] | TritonKV,
        routing: Routing | None = None,
        aux: AuxLosses | None = None,
        defer_combine: bool = False,
    ) -> Tensor | fused.CombineInputs:
        """h (N, d) fp32 -> (N, d) fp32. At inference h may be the previous block's MoE
        combine, unevaluated (`fused.CombineInputs`): this block's first norm combines it
        in its own launch; with `defer_combine` (the next block takes it so) this block's
        MoE may return its own combine unevaluated. Either way the values are the eager
        block's, bitwise."""
        an, fn = self.attn_norm, self.ffn_norm
        if isinstance(h, fused.CombineInputs):
            h, x = fused.combine_rms_norm_to(h, an.gamma, an.eps, self.dtype)
        else:
            x = fused.rms_norm_to(h, an.gamma, an.eps, self.dtype)
        a = self.attn(x, positions, spans, caches, aux, routing)
        h, x = fused.add_rms_norm_to(h, a, fn.gamma, fn.eps, self.dtype)
        if isinstance(self.ffn, MoE):  # the MoE adds its output to the residual itself
            out = self.ffn(x, routing, aux, residual=h, defer_combine=defer_combine)
            # an unevaluated combine exists only without autograd: no gradient to clamp
            return out if isinstance(out, fused.CombineInputs) else self.clamp(out)
        return self.clamp(h + self.ffn(x).float())
