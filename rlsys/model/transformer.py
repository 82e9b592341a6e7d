"""The policy model: embedding, blocks (3:1 gated SWA : Sparse GQA, MoE FFN), LM head, MTP.

Two entry points share one code path (`_trunk`), on either kernel path:
- the reference path (CPU): attention reads per-sequence `ModelCache`s;
- the Triton path (CUDA, or `RLSYS_KERNELS=triton`): attention reads a `TritonKV` built once
  per forward: the trainer's packed K/V, or the engine's `PagePool` (caches are then
  `PagedSeqCache`s; `attach_page_pool` turns it on). One batched launch per kernel serves
  every sequence of the step.
- `forward(tokens (B, T))`: the trainer's full-sequence forward (fresh caches per row).
- `forward_step(chunks, caches)`: the engine's incremental forward. Each chunk is the next
  tokens of one sequence (a prefill chunk or one decode token); all chunks are packed into
  one batch of rows for the projections and experts, attention runs per sequence on its
  `ModelCache`. Invariant: because every reduction is row-invariant (rlsys.kernels), a
  token's log-probs do not depend on how its sequence was chunked or what it was batched
  with; `tests/model/test_incremental.py` checks prefill vs token-by-token decode bitwise.
Tensor legend: B batch, T time, N packed rows, V vocabulary, d width.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from rlsys import kernels
from rlsys.config.model import ModelConfig
from rlsys.kernels.dispatch import use_triton
from rlsys.model.attention import SeqSpan, init_weight
from rlsys.model.aux import AuxLosses
from rlsys.model.block import Block
from rlsys.model.cache import LayerCache, ModelCache
from rlsys.model.kv_layout import TritonKV, packed_kv, paged_kv
from rlsys.model.moe import MoE
from rlsys.model.mtp import MTPHead
from rlsys.model.norm import ZeroCenteredRMSNorm
from rlsys.model.paged_cache import PagedSeqCache, PagePool
from rlsys.model.routing import Routing, RoutingReplay
from rlsys.model.trunk_graphs import BlockRunner, TrunkBuilder, TrunkGraphs

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

# At inference, a block's MoE combine left to the next block's first norm (one launch
# instead of two per block: `fused.combine_rms_norm_to`), bitwise the same values. On: with
# one row per program it ran 1-2% faster than the two launches under PDL on the H100 (GPU
# per decode step 3.08 -> 3.02 ms at batch 1, 6.49 -> 6.42 at 64, 14.74 -> 14.73 at 256;
# `bench_engine_gpu.py --combine-norm on,off`). `RLSYS_DEFER_COMBINE=0` turns it off.
DEFER_COMBINE = os.environ.get("RLSYS_DEFER_COMBINE", "1") == "1"


@dataclass
class ModelOutput:
    """Full-forward result. `mtp_logits[i]` (B, T, V) predicts token t + 2 + i."""

    logits: Tensor
    hidden: Tensor
    mtp_logits: list[Tensor] = field(default_factory=list)


class Transformer(nn.Module):
    """Deep Sparse GQA MoE transformer built from a `ModelConfig`."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.dtype = _DTYPES[cfg.compute_dtype]
        self.embed = init_weight((cfg.vocab_size, cfg.d_model), 1.0, self.dtype)
        self.blocks = nn.ModuleList(
            Block(cfg, kind, i, self.dtype) for i, kind in enumerate(cfg.layer_kinds())
        )
        self.final_norm = ZeroCenteredRMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = init_weight((cfg.vocab_size, cfg.d_model), cfg.init_std, self.dtype)
        self.mtp = nn.ModuleList(MTPHead(cfg, self.dtype) for _ in range(cfg.mtp_depth))
        counters = {"swa": 0, "sparse": 0}
        for block in self.blocks:
            block.attn.kind_index = counters[block.kind]
            counters[block.kind] += 1
        self.page_pool: PagePool | None = None
        # Training: recompute each block in the backward instead of keeping its activations
        # (the trainer's `activation_checkpointing`); same gradients, bitwise.
        self.checkpoint_blocks = False
        # Training: the packed trunk replayed as CUDA graphs (`trunk_graphs`), or None
        self.trunk_graphs: TrunkGraphs | None = None
        # bumped by every load_state_dict: decode graphs refresh their fused weights then
        self.weights_generation = 0
        self.register_load_state_dict_post_hook(Transformer._loaded)

    # ---- engine: incremental ------------------------------------------------------------

    def attach_page_pool(self, pool: PagePool | None) -> None:
        """Serve incremental forwards from `pool` (the Triton path); None: per-seq caches."""
        self.page_pool = pool

    def new_cache(self, device: torch.device | str = "cpu") -> ModelCache | PagedSeqCache:
        """An empty cache for one sequence: pages of the pool, else one cache per block."""
        if self.page_pool is not None:
            return PagedSeqCache()
        dev = torch.device(device)
        return ModelCache([b.attn.new_cache(self.dtype, dev) for b in self.blocks])

    def forward_step(
        self,
        chunks: list[Tensor],
        caches: list[ModelCache] | list[PagedSeqCache],
        routing: Routing | None = None,
        aux: AuxLosses | None = None,
    ) -> list[Tensor]:
        """Feed each sequence its next tokens; returns per chunk fp32 logits (n_i, V).

        Positions continue from `cache.length`; caches are updated in place. A recorder
        gets the routes of the packed rows (chunk after chunk); a replay must match them.
        """
        return self.forward_step_hidden(chunks, caches, routing, aux)[0]

    def forward_step_hidden(
        self,
        chunks: list[Tensor],
        caches: list[ModelCache] | list[PagedSeqCache],
        routing: Routing | None = None,
        aux: AuxLosses | None = None,
    ) -> tuple[list[Tensor], list[Tensor]]:
        """`forward_step`, plus per chunk the fp32 final hidden rows (n_i, d) (the MTP
        heads' input when the engine drafts)."""
        assert all(chunk.numel() > 0 for chunk in chunks), "every chunk needs a token"
        spans, row = [], 0
        for chunk, cache in zip(chunks, caches, strict=True):
            spans.append(SeqSpan(row, chunk.shape[0], cache.length))
            row += chunk.shape[0]
        tokens = torch.cat(chunks)
        positions = self._positions(spans, tokens.device)
        if caches and isinstance(caches[0], PagedSeqCache):
            assert self.page_pool is not None, "paged caches need attach_page_pool"
            kv = paged_kv(self.cfg, self.page_pool, spans, caches)  # type: ignore[arg-type]
            h = self._blocks(self._embed(tokens), positions, spans, lambda _: kv, routing, aux)
        else:
            layer_kv = lambda i: [c.layers[i] for c in caches]  # type: ignore[union-attr]  # noqa: E731
            h = self._blocks(self._embed(tokens), positions, spans, layer_kv, routing, aux)
        for span, cache in zip(spans, caches, strict=True):
            cache.length += span.n
            if isinstance(cache, PagedSeqCache):
                self.page_pool.trim_window(cache)  # type: ignore[union-attr]
        logits = self.logits(h)
        rows = [slice(s.row, s.row + s.n) for s in spans]
        return [logits[r] for r in rows], [h[r] for r in rows]

    def forward_decode(
        self, tokens: Tensor, positions: Tensor, kv: TritonKV, routing: Routing | None = None
    ) -> Tensor:
        """One decode row per sequence over fixed-shape addresses (`StaticDecodeLayout`):
        tokens/positions (B,) -> fp32 logits (B, V). No host value shapes anything here, so
        the engine can capture it as a CUDA graph; caches are advanced by the layout."""
        spans = [SeqSpan(i, 1, 0) for i in range(tokens.shape[0])]  # unread on the Triton path
        return self.logits(
            self._blocks(self._embed(tokens), positions, spans, lambda _: kv, routing, None)
        )

    @staticmethod
    def _loaded(module: nn.Module, incompatible: object) -> None:
        assert isinstance(module, Transformer)
        module.weights_generation += 1
        if module.trunk_graphs is not None:  # a load may have replaced parameter storage
            module.trunk_graphs.clear()

    def refresh_fused(self) -> None:
        """Bring every fused inference weight up to date with its parameters: a CUDA graph
        reads the fused buffers it captured, so the engine calls this before a replay
        (eager forwards check on their own)."""
        for block in self.blocks:
            block.refresh_fused()

    # ---- trainer: full sequences --------------------------------------------------------

    def forward(
        self,
        tokens: Tensor,
        routing: Routing | None = None,
        aux: AuxLosses | None = None,
        with_mtp: bool = True,
    ) -> ModelOutput:
        """tokens (B, T) -> logits (B, T, V) fp32 predicting t + 1 (plus MTP heads)."""
        bsz, t = tokens.shape
        spans = [SeqSpan(i * t, t, 0) for i in range(bsz)]
        h = self._trunk_packed(tokens.reshape(-1), spans, routing, aux)
        out = ModelOutput(self.logits(h).view(bsz, t, -1), h.view(bsz, t, -1))
        if with_mtp and len(self.mtp):
            positions = self._positions(spans, h.device)
            h_prev = h
            for depth, head in enumerate(self.mtp, start=1):
                shifted = torch.nn.functional.pad(tokens[:, depth:], (0, depth)).reshape(-1)
                emb = torch.nn.functional.embedding(shifted, self.embed).float()
                h_prev, normed = head(h_prev, emb, positions, spans)
                mtp_logits = kernels.linear(normed, self.lm_head).float()
                out.mtp_logits.append(mtp_logits.view(bsz, t, -1))
        return out

    def hidden_packed(
        self,
        tokens: Tensor,
        spans: list[SeqSpan],
        routing: Routing | None = None,
        aux: AuxLosses | None = None,
    ) -> Tensor:
        """The trainer's packed varlen forward: sequences of any lengths as spans of rows of
        `tokens` (N,), each from position 0 (fresh caches) -> fp32 final hidden rows (N, d).

        No LM head: the trainer applies it (`head_logits`) to the rows it needs, in chunks.
        """
        assert all(s.pos == 0 for s in spans), "a packed training sequence starts at 0"
        return self._trunk_packed(tokens, spans, routing, aux)

    def set_activation_checkpointing(self, on: bool) -> None:
        """Recompute each block in the backward (training) instead of storing activations."""
        self.checkpoint_blocks = on

    def set_trunk_graphs(self, on: bool) -> None:
        """Replay the packed training trunk as CUDA graphs where `TrunkGraphs.applies`."""
        self.trunk_graphs = TrunkGraphs() if on else None

    def head_logits(self, h: Tensor) -> Tensor:
        """Final norm + LM head in the compute dtype: fp32 hidden rows (..., d) -> (..., V)."""
        return kernels.linear(self.final_norm(h).to(self.dtype), self.lm_head)

    def logits(self, h: Tensor) -> Tensor:
        """Final norm + LM head: fp32 hidden rows (..., d) -> fp32 logits (..., V)."""
        return self.head_logits(h).float()

    # ---- shared ---------------------------------------------------------------------------

    def _trunk_packed(
        self, tokens: Tensor, spans: list[SeqSpan], routing: Routing | None, aux: AuxLosses | None
    ) -> Tensor:
        """Sequences from position 0: packed K/V (Triton) or fresh per-sequence caches."""
        dev = tokens.device
        if use_triton(tokens):
            graphs = self.trunk_graphs
            if graphs is not None and graphs.applies(
                self, tokens, routing, self.checkpoint_blocks, self._tp_degree()
            ):
                assert routing is None or isinstance(routing, RoutingReplay)
                h = self._embed(tokens)
                return graphs.run(self.blocks, h, spans, routing, aux, self._packed(spans, dev))
            positions = self._positions(spans, dev)
            kv = packed_kv(self.cfg, spans, dev)
            return self._blocks(self._embed(tokens), positions, spans, lambda _: kv, routing, aux)

        def fresh_caches(i: int) -> list[LayerCache]:
            # fresh per call: a checkpointed block's recomputation must not see the K/V its
            # first pass appended
            return [self.blocks[i].attn.new_cache(self.dtype, dev) for _ in spans]

        positions = self._positions(spans, dev)
        return self._blocks(self._embed(tokens), positions, spans, fresh_caches, routing, aux)

    def _embed(self, tokens: Tensor) -> Tensor:
        """The fp32 residual stream's first rows. F.embedding, not indexing: its backward
        sums duplicate tokens in one pass (index_put runs them serially on CUDA); the
        forward is the same copy."""
        return torch.nn.functional.embedding(tokens, self.embed).float()

    def _blocks(
        self,
        h: Tensor,
        positions: Tensor,
        spans: list[SeqSpan],
        layer_kv: Callable[[int], list[LayerCache] | TritonKV],
        routing: Routing | None,
        aux: AuxLosses | None,
    ) -> Tensor:
        recompute = self.checkpoint_blocks and self.training and torch.is_grad_enabled()
        last = len(self.blocks) - 1
        for i, block in enumerate(self.blocks):
            if recompute:
                # the recomputation adds its aux losses again and its expert load twice:
                # neither reaches the loss (already built), and a doubled load keeps the
                # sign the selection-bias update reads
                def run(h: Tensor, i: int = i, block: Block = block) -> Tensor:
                    return block(h, positions, spans, layer_kv(i), routing, aux)

                h = checkpoint(run, h, use_reentrant=False)
            else:
                # a block's MoE combine may be left to the next block's first norm (one
                # launch fewer per block at inference; `Block.forward`), never the last's
                h = block(
                    h,
                    positions,
                    spans,
                    layer_kv(i),
                    routing,
                    aux,
                    defer_combine=DEFER_COMBINE and i < last,
                )
        assert isinstance(h, Tensor)
        return h

    def _packed(self, spans: list[SeqSpan], dev: torch.device) -> TrunkBuilder:
        """The eager trunk over the packed layout `spans`, built on demand (a graph replay
        reads the layout it captured and builds nothing)."""

        def build() -> tuple[BlockRunner, tuple]:
            positions = self._positions(spans, dev)
            kv = packed_kv(self.cfg, spans, dev)

            def blocks(h: Tensor, routing: Routing | None, aux: AuxLosses | None) -> Tensor:
                return self._blocks(h, positions, spans, lambda _: kv, routing, aux)

            return blocks, (positions, kv)

        return build

    def _tp_degree(self) -> int:
        """The tensor-parallel degree of the FFNs (1: no collectives inside the trunk)."""
        return max(b.ffn.row_parallel.degree for b in self.blocks)

    @staticmethod
    def _positions(spans: list[SeqSpan], device: torch.device) -> Tensor:
        return torch.cat([torch.arange(s.pos, s.pos + s.n, device=device) for s in spans])

    # ---- training bookkeeping --------------------------------------------------------------

    def engine_state_dict(self) -> dict[str, Tensor]:
        """The weights as an engine replica loads them (our engine: the state dict itself)."""
        return self.state_dict()

    def update_balance(self) -> None:
        """Call after each optimiser step: MoE selection-bias update from the step's load."""
        for module in self.modules():
            if isinstance(module, MoE):
                module.update_balance()

    def grad_clamp_clipped(self) -> Tensor:
        """Gradient vectors the blocks' clamps have clipped since the last reset: an int64
        scalar on the device, not read (the trainer reads it with the step's other values)."""
        if not len(self.blocks):
            return torch.zeros((), dtype=torch.int64, device=self.embed.device)
        return torch.stack([b.clamp.counters[0] for b in self.blocks]).sum()

    def num_parameters(self, active: bool = False) -> int:
        """All parameters, or those one token uses (top-k of the routed experts, no MTP)."""
        total = sum(p.numel() for p in self.parameters())
        if not active:
            return total
        cfg, unused = self.cfg, 0
        for module in self.modules():
            if isinstance(module, MoE):
                per_expert = module.w1[0].numel() + module.w2[0].numel() + module.w3[0].numel()
                unused += per_expert * (cfg.n_experts - cfg.experts_per_token)
        unused += sum(p.numel() for p in self.mtp.parameters())
        return total - unused
