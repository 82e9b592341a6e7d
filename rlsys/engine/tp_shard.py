"""Tensor-parallel shards of the model: which weights a rank holds and how it is built.

The fixed 8-way split (`rlsys.kernels.tp`) decides everything: rank r of degree t owns
chunks [8r/t, 8(r+1)/t) of every row-parallel input dimension.
- Attention: the output projection's input (heads x head_dim) is split in 8 chunks; a rank
  computes attention for the KV groups its chunks touch (whole groups, so every attention
  item keeps the shape it has at TP=1: tile x heads-per-group rows), and feeds the columns
  of its chunks to its slice of `wo`. Above `n_kv_groups` ranks, groups are replicated.
- FFN / experts: the hidden dimension of every expert (routed and shared) is split in 8
  chunks; a rank holds those rows of w1/w3 and columns of w2.
- Everything else (embedding, norms, router, indexer keys, LM head) is replicated, so it
  runs with the same shapes as at TP=1.
A shard is an ordinary `Transformer` built from a local `ModelConfig` (fewer heads, groups,
expert width; no MTP heads) whose row-parallel projections reduce through `RowParallel`.
Column slices of a fixed-tile product equal the full product's columns, and replicated work
has TP=1 shapes, so the shard's logits are bitwise the TP=1 model's.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from rlsys.config.model import ModelConfig
from rlsys.kernels.tp import SPLITS, TP_DEGREES, Gather, RowParallel
from rlsys.model import Transformer
from rlsys.model.attention import AttentionProjections
from rlsys.model.moe import MoE, SwiGLU


@dataclass(frozen=True)
class ShardPlan:
    """Index ranges of one rank (all half-open)."""

    degree: int
    rank: int
    groups: tuple[int, int]  # KV groups computed
    heads: tuple[int, int]  # query heads computed (whole groups)
    out_cols: tuple[int, int]  # wo input columns owned, relative to the local heads
    wo_cols: tuple[int, int]  # the same columns in the full wo
    hidden: tuple[int, int]  # routed-expert hidden rows owned
    shared_hidden: tuple[int, int]  # shared-expert hidden rows owned


def tp_error(cfg: ModelConfig, degree: int) -> str | None:
    """Why `cfg` cannot be split `degree` ways, or None."""
    if degree not in TP_DEGREES:
        return f"tp={degree} must be one of {TP_DEGREES}"
    width, hkv = cfg.n_heads * cfg.head_dim, cfg.n_kv_groups
    if width % SPLITS or cfg.expert_hidden % SPLITS:
        return f"n_heads*head_dim ({width}) and expert_hidden must be multiples of {SPLITS}"
    if (hkv % degree) if degree <= hkv else (degree % hkv):
        return f"n_kv_groups={hkv} and tp={degree}: one must divide the other"
    return None


def shard_plan(cfg: ModelConfig, degree: int, rank: int) -> ShardPlan:
    error = tp_error(cfg, degree)
    if error is not None:
        raise ValueError(error)
    per_chunk = cfg.n_heads * cfg.head_dim // SPLITS
    c0, c1 = rank * SPLITS // degree, (rank + 1) * SPLITS // degree
    g = cfg.n_heads // cfg.n_kv_groups
    h0, h1 = c0 * per_chunk // cfg.head_dim, math.ceil(c1 * per_chunk / cfg.head_dim)
    g0, g1 = h0 // g, math.ceil(h1 / g)
    base = g0 * g * cfg.head_dim
    hid, shared = cfg.expert_hidden, cfg.expert_hidden * cfg.n_shared_experts
    return ShardPlan(
        degree=degree,
        rank=rank,
        groups=(g0, g1),
        heads=(g0 * g, g1 * g),
        out_cols=(c0 * per_chunk - base, c1 * per_chunk - base),
        wo_cols=(c0 * per_chunk, c1 * per_chunk),
        hidden=(rank * hid // degree, (rank + 1) * hid // degree),
        shared_hidden=(rank * shared // degree, (rank + 1) * shared // degree),
    )


def local_config(cfg: ModelConfig, plan: ShardPlan) -> ModelConfig:
    """The shapes one rank holds. Not re-validated: a shard's widths are the full model's
    divided by the degree (the 8-multiple rule applies to the full model, checked there)."""
    groups = plan.groups[1] - plan.groups[0]
    local = {
        "n_heads": groups * (cfg.n_heads // cfg.n_kv_groups),
        "n_kv_groups": groups,
        "expert_hidden": cfg.expert_hidden // plan.degree,
        "mtp_depth": 0,
    }
    return ModelConfig.model_construct(**{**cfg.model_dump(), **local})


def shard_state(
    cfg: ModelConfig, state: Mapping[str, Tensor], plan: ShardPlan
) -> dict[str, Tensor]:
    """The rank's slices of a full (TP=1) state dict; MTP heads are left out."""
    hd, idx = cfg.head_dim, cfg.index_dim
    heads, groups = plan.heads, plan.groups
    rows: list[tuple[str, Callable[[Tensor], Tensor]]] = [
        (r"attn\.proj\.wq$", lambda t: t[heads[0] * hd : heads[1] * hd]),
        (r"attn\.proj\.w[kv]$", lambda t: t[groups[0] * hd : groups[1] * hd]),
        (r"attn\.proj\.wgate$", lambda t: t[heads[0] : heads[1]]),
        (r"attn\.proj\.wo$", lambda t: t[:, plan.wo_cols[0] : plan.wo_cols[1]]),
        (r"attn\.w_index_q$", lambda t: t[groups[0] * idx : groups[1] * idx]),
        # routed experts are stacked (E, H, d) / (E, d, H); a dense FFN is (H, d) / (d, H)
        (r"ffn\.w[13]$", lambda t: t[..., plan.hidden[0] : plan.hidden[1], :]),
        (r"ffn\.w2$", lambda t: t[..., plan.hidden[0] : plan.hidden[1]]),
        (r"ffn\.shared\.w[13]$", lambda t: t[plan.shared_hidden[0] : plan.shared_hidden[1]]),
        (r"ffn\.shared\.w2$", lambda t: t[:, plan.shared_hidden[0] : plan.shared_hidden[1]]),
    ]
    out = {}
    for name, tensor in state.items():
        if name.startswith("mtp."):
            continue
        cut = next((fn for pattern, fn in rows if re.search(pattern, name)), None)
        out[name] = (cut(tensor) if cut is not None else tensor).clone()
    return out


def build_shard(
    cfg: ModelConfig, state: Mapping[str, Tensor], degree: int, rank: int, gather: Gather | None
) -> Transformer:
    """Rank `rank`'s model, weights loaded, row-parallel reductions wired to `gather`."""
    plan = shard_plan(cfg, degree, rank)
    row_parallel = RowParallel(degree, rank, gather if degree > 1 else None)
    with torch.device("meta"):
        model = Transformer(local_config(cfg, plan))
        for module in model.modules():
            if isinstance(module, AttentionProjections):
                module.row_parallel = row_parallel
                module.out_cols = plan.out_cols
                # a rank may compute more heads than its chunks of wo (replicated groups)
                cols = plan.wo_cols[1] - plan.wo_cols[0]
                module.wo = nn.Parameter(torch.empty(cfg.d_model, cols, dtype=module.wo.dtype))
            elif isinstance(module, MoE | SwiGLU):
                module.row_parallel = row_parallel
    model.load_state_dict(shard_state(cfg, state, plan), assign=True)
    for module in model.modules():  # non-persistent buffers (not in a state dict) stay meta
        for name, buf in list(module.named_buffers(recurse=False)):
            if buf.is_meta:
                module.register_buffer(name, torch.zeros_like(buf, device="cpu"), persistent=False)
    return model.eval()


def load_shard(model: Transformer, cfg: ModelConfig, state: Mapping[str, Tensor]) -> None:
    """Load a new full (TP=1) state into an existing shard (a weight update)."""
    rp = next(m.row_parallel for m in model.modules() if isinstance(m, AttentionProjections))
    model.load_state_dict(shard_state(cfg, state, shard_plan(cfg, rp.degree, rp.rank)))
