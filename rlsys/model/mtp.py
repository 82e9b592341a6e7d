"""Multi-token prediction heads: full-sequence forward (training) and cached steps (drafts).

Head d (1-based) combines the previous depth's hidden state at t with the embedding of
token t + d, runs one SWA block with a dense FFN, and predicts token t + 1 + d through the
shared LM head. Rows whose token t + d lies beyond the sequence carry no target.
`step` runs the same block over the next rows of one or more sequences with their own SWA
caches (the engine's drafter, `rlsys.engine.mtp_drafter`); by the kernels' chunking
invariance its rows equal the full forward's.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from rlsys import kernels
from rlsys.config.model import ModelConfig
from rlsys.kernels.dispatch import use_triton
from rlsys.model.attention import SeqSpan, init_weight
from rlsys.model.block import Block
from rlsys.model.cache import SlidingKVCache
from rlsys.model.kv_layout import TritonKV, packed_kv
from rlsys.model.norm import ZeroCenteredRMSNorm


class MTPHead(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.norm_hidden = ZeroCenteredRMSNorm(cfg.d_model, cfg.norm_eps)
        self.norm_embed = ZeroCenteredRMSNorm(cfg.d_model, cfg.norm_eps)
        self.proj = init_weight((cfg.d_model, 2 * cfg.d_model), cfg.init_std, dtype)
        self.block = Block(cfg, "swa", None, dtype)
        self.final_norm = ZeroCenteredRMSNorm(cfg.d_model, cfg.norm_eps)

    def forward(
        self, h_prev: Tensor, next_embed: Tensor, positions: Tensor, spans: list[SeqSpan]
    ) -> tuple[Tensor, Tensor]:
        """Returns (hidden fp32 (N, d), normed hidden in compute dtype for the LM head).

        On the Triton path the spans (each from position 0) are attended as one packed batch,
        as the trunk's blocks are (the per-sequence caches of `step` would run the reference
        attention, chunk by chunk); the drafter's `step` gives the same function."""
        if use_triton(h_prev):
            kv = packed_kv(self.block.attn.cfg, spans, h_prev.device)
            return self.step(h_prev, next_embed, positions, spans, kv)
        caches = [self.block.attn.new_cache(self.dtype, h_prev.device) for _ in spans]
        return self.step(h_prev, next_embed, positions, spans, caches)

    def step(
        self,
        h_prev: Tensor,
        next_embed: Tensor,
        positions: Tensor,
        spans: list[SeqSpan],
        caches: list[SlidingKVCache] | TritonKV,
    ) -> tuple[Tensor, Tensor]:
        """`forward` over rows that continue each span's cache (updated in place)."""
        joint = torch.cat([self.norm_hidden(h_prev), self.norm_embed(next_embed)], dim=-1)
        h = kernels.linear(joint.to(self.dtype), self.proj).float()
        h = self.block(h, positions, spans, caches)
        return h, self.final_norm(h).to(self.dtype)
