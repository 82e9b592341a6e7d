"""MoE feed-forward: sigmoid router, top-k experts, shared experts, load balancing.

Invariants:
- The router runs in fp32 (fp32 weights) so selection is not decided by bf16 rounding.
- Gates are the selected sigmoid scores normalised to sum to 1 (in-order fold); the
  selection bias (aux-loss-free balancing) changes which experts are chosen, never a gate.
- Expert outputs are combined by `kernels.moe_combine` in top-k slot order, so a token's
  output does not depend on which other tokens were routed with it.
- Inference on the Triton path routes, lays rows out by expert and combines (with the
  residual add) in kernels without a sort (`triton_ops.moe_route`); each value is bitwise
  the unfused path's, which training runs (and the same selection kernel decides there).
- A `RoutingReplay` replaces the router's choice; with gates it reproduces the recorded
  forward bitwise, without gates the router recomputes them and keeps its gradient.
- Routed experts are stacked weights (w1/w3 (E, H, d), w2 (E, d, H)). On the reference
  path each expert runs the SwiGLU math on its rows; on the Triton path one grouped launch
  per projection serves every expert (rows sorted by expert, no Python loop over experts).
  Both give a token's row the same value whatever other tokens share the call.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor, nn

from rlsys import kernels
from rlsys.config.model import ModelConfig
from rlsys.kernels import fused
from rlsys.kernels.dispatch import use_triton
from rlsys.kernels.sorting import stable_argsort
from rlsys.kernels.tp import RowParallel
from rlsys.model.attention import init_weight
from rlsys.model.aux import AuxLosses
from rlsys.model.fused_weights import FusedWeight
from rlsys.model.routing import Routing, RoutingRecorder, RoutingReplay

# Training's grouped SwiGLU reads the cached [w1; w3] (`MoE._caches_stack`);
# `RLSYS_CACHED_EXPERT_STACK=0` concatenates per call (a benchmark's switch)
CACHED_EXPERT_STACK = os.environ.get("RLSYS_CACHED_EXPERT_STACK", "1") == "1"


def swiglu_hidden(x: Tensor, w1: Tensor, w3: Tensor, w13: FusedWeight | None = None) -> Tensor:
    """silu(x w1^T) * (x w3^T) in the weights' dtype. `w13`: the cached [w1; w3] that an
    inference forward reads instead of concatenating the weights at every call (a copy of
    both per block and decode step); the product is the same, so are its bits."""
    if use_triton(x):
        from rlsys.kernels.triton_ops.autograd import SwiGLU as SwiGLUKernel

        rows = x.reshape(-1, x.shape[-1])
        if w13 is not None and fused.fusable(x, w1, w3):
            from rlsys.kernels.triton_ops.products import products

            return products().swiglu(rows, w1, w3, w13.get([w1, w3]))
        return SwiGLUKernel.apply(rows, w1, w3)
    return kernels.silu(kernels.linear(x, w1)) * kernels.linear(x, w3)


class SwiGLU(nn.Module):
    """`w2 (silu(w1 x) * w3 x)`; every product is row-invariant, and w2 (which reduces over
    the hidden width that TP splits) is the fixed 8-chunk tree of `kernels.tp`; fp32 out."""

    def __init__(self, d: int, hidden: int, std: float, out_std: float, dtype: torch.dtype):
        super().__init__()
        self.w1 = init_weight((hidden, d), std, dtype)
        self.w3 = init_weight((hidden, d), std, dtype)
        self.w2 = init_weight((d, hidden), out_std, dtype)
        self.row_parallel = RowParallel()
        self._w13 = FusedWeight(1)  # [w1; w3] for inference (no padding: halves at `hidden`)

    def hidden(self, x: Tensor) -> Tensor:
        """silu(x w1^T) * (x w3^T), (rows, hidden) on the Triton path."""
        return swiglu_hidden(x, self.w1, self.w3, self._w13)

    def partial(self, x: Tensor) -> Tensor:
        """This TP rank's subtotal of the output (the whole output at TP=1)."""
        return self.row_parallel.partial(self.hidden(x), self.w2)

    def refresh_fused(self) -> None:
        """Bring the cached [w1; w3] up to date (before a CUDA-graph replay)."""
        self._w13.refresh([self.w1, self.w3])

    def forward(self, x: Tensor) -> Tensor:
        return self.row_parallel.reduce(self.partial(x))


class MoE(nn.Module):
    """Routed + shared SwiGLU experts of one block; `layer` is its index in routing records."""

    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg, self.layer = cfg, layer
        d, std = cfg.d_model, cfg.init_std
        out_std = std / (2 * cfg.n_layers) ** 0.5
        self.router = init_weight((cfg.n_experts, d), std, torch.float32)
        e, hid = cfg.n_experts, cfg.expert_hidden
        self.w1 = init_weight((e, hid, d), std, dtype)
        self.w3 = init_weight((e, hid, d), std, dtype)
        self.w2 = init_weight((e, d, hid), out_std, dtype)
        self.shared = (
            SwiGLU(d, cfg.expert_hidden * cfg.n_shared_experts, std, out_std, dtype)
            if cfg.n_shared_experts
            else None
        )
        self.register_buffer("expert_bias", torch.zeros(cfg.n_experts))
        self.register_buffer("expert_load", torch.zeros(cfg.n_experts))
        self.row_parallel = RowParallel()
        # every expert's [w1; w3] (E, 2H, d) for inference: one grouped product for both
        self._w13 = FusedWeight(1, dim=1)
        self.stack_cache = True  # training reads `_w13` too (`_caches_stack`)

    def forward(
        self,
        x: Tensor,
        routing: Routing | None = None,
        aux: AuxLosses | None = None,
        residual: Tensor | None = None,
        defer_combine: bool = False,
    ) -> Tensor | fused.CombineInputs:
        """x (N, d) in compute dtype -> (N, d) fp32; plus `residual` (N, d) fp32 if given.
        `defer_combine`: the caller norms the result next, so the fused inference path may
        return the combine's operands (`fused.CombineInputs`) for the norm to combine in
        its own launch (`fused.combine_rms_norm_to`); other paths return the tensor."""
        if residual is not None and self._fusable(x, routing):
            return self._forward_fused(x, routing, residual, defer_combine)
        raw = kernels.linear(x, self.router)  # (N, E) fp32
        scores = fused.sigmoid(raw)
        idx, gates = self._route(scores, routing)
        counts = _expert_counts(idx, self.cfg.n_experts)
        if self.training:
            self.expert_load += counts
            if aux is not None and self.cfg.balance == "aux_loss":
                aux.add(
                    "moe_balance",
                    self.cfg.aux_loss_weight * self._balance_loss(scores, counts, idx.numel()),
                )
        if residual is not None and use_triton(x) and self.row_parallel.degree == 1:
            return self._combined(x, idx, counts, gates, residual)
        expert_out = self._run_experts(x, idx, counts)
        shared = self._shared_partial(x)
        expert_out, shared = self._reduce(expert_out, shared)
        out = kernels.moe_combine(expert_out, gates, shared)
        return out if residual is None else residual + out

    def _combined(
        self, x: Tensor, idx: Tensor, counts: Tensor, gates: Tensor, residual: Tensor
    ) -> Tensor:
        """The Triton path on one rank: the combine and the residual add as the inference
        kernel computes them, reading the experts' rows where the sort put them (`Combine`:
        bitwise `residual + moe_combine(...)`, with a batched backward), or with the
        experts' down projection as one node (`TreeCombine`, `autograd.TREE_COMBINE`)."""
        from rlsys.kernels.triton_ops import autograd as ag

        order, inverse = self._expert_order(idx)
        x_sorted = self._sorted_rows(x, order, inverse, idx)
        pos = inverse.view(idx.shape)
        if not ag.TREE_COMBINE:  # the down projection and the combine as two nodes
            ys = self._grouped(x_sorted, counts)
            return ag.Combine.apply(residual, ys, pos, gates, self._shared_partial(x))
        hidden, offsets, tiles, empty = self._grouped_hidden(x_sorted, counts)
        return ag.TreeCombine.apply(
            residual, hidden, self.w2, offsets, tiles, self.row_parallel.chunks, empty, pos,
            gates, self._shared_partial(x),
        )  # fmt: skip

    def _shared_partial(self, x: Tensor) -> Tensor | None:
        """The shared expert's (partial, on a TP rank) output for `x`, or None without one."""
        return self.shared.partial(x) if self.shared is not None else None

    def refresh_fused(self) -> None:
        """Bring the cached [w1; w3] weights up to date (before a CUDA-graph replay)."""
        self._w13.refresh([self.w1, self.w3])
        if self.shared is not None:
            self.shared.refresh_fused()

    def _fusable(self, x: Tensor, routing: Routing | None) -> bool:
        from rlsys.kernels.triton_ops.moe_route import RANK_MAX

        return (
            fused.fusable(x, self.router)
            and not self.training
            and not isinstance(routing, RoutingReplay)
            and self.row_parallel.degree == 1
            and self.cfg.n_experts <= RANK_MAX
        )

    def _forward_fused(
        self, x: Tensor, routing: Routing | None, residual: Tensor, defer_combine: bool
    ) -> Tensor | fused.CombineInputs:
        """Inference: routing, expert layout and combine as kernels without a sort
        (`triton_ops.moe_route`); the products as the linear dispatcher computes them in
        training, the router's and the down projections' chunk products summed by the
        kernels that read them where the dispatcher runs them on the Triton kernels
        (`triton_ops.partials`); bitwise the unfused path's values."""
        from rlsys.kernels.triton_ops import grouped_decode as gd
        from rlsys.kernels.triton_ops import moe_route as mr
        from rlsys.kernels.triton_ops.linear import BM, column_chunks
        from rlsys.kernels.triton_ops.partials import partial_products, triton_computes
        from rlsys.kernels.triton_ops.products import decode_tree_holds, products

        cfg, k = self.cfg, self.cfg.experts_per_token
        partials = fused.partials_ok(x)
        if partials and triton_computes("column", self.router):
            raw = partial_products(x, self.router, column_chunks(x.shape[1]))
        else:
            raw = kernels.linear(x, self.router)
        idx, gates = mr.route_fwd(raw, self.expert_bias, k)
        if isinstance(routing, RoutingRecorder):
            routing.add(self.layer, idx, gates)
        max_tiles = -(-idx.numel() // BM) + cfg.n_experts
        pos, order, offsets, tiles = mr.expert_layout(idx, cfg.n_experts, max_tiles, BM)
        w13 = self._w13.get([self.w1, self.w3]) if products().stacks_experts(self.w1) else None
        if products().decode_swiglu(w13, order.shape[0]):  # the gather read in place
            hidden = gd.grouped_swiglu_rows(x, w13, offsets, order, k)  # type: ignore[arg-type]
        else:
            xs = mr.gather_rows(x, order, k)
            hidden = products().grouped_swiglu(xs, self.w1, self.w3, offsets, tiles, w13)
        chunks = self.row_parallel.chunks
        if partials and triton_computes("grouped_tree", self.w2):
            if gd.decode_sized(hidden.shape[0]) and decode_tree_holds(self.w2, chunks):
                ys = gd.grouped_tree_rows(hidden, self.w2, offsets, chunks)
            else:
                ys = partial_products(hidden, self.w2, chunks, tiles)
        else:
            ys = products().grouped_tree(hidden, self.w2, offsets, tiles, chunks)
        shared = None
        if self.shared is not None:  # `SwiGLU.partial`, its down projection's chunks unreduced
            sw = self.shared
            shared = sw.hidden(x)
            if partials and triton_computes("row_tree", sw.w2):
                shared = partial_products(shared, sw.w2, sw.row_parallel.chunks)
            else:
                shared = sw.row_parallel.partial(shared, sw.w2)
        combine = fused.CombineInputs(residual, ys, pos, gates, shared)
        return combine if defer_combine else combine.materialise()

    def _reduce(self, expert_out: Tensor, shared: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """Combine TP ranks' subtotals (routed and shared experts in one gather)."""
        if self.row_parallel.degree == 1:
            return expert_out, shared
        n, k, d = expert_out.shape
        parts = [expert_out.reshape(n, k * d)] + ([shared] if shared is not None else [])
        full = self.row_parallel.reduce(torch.cat(parts, dim=-1))
        return full[:, : k * d].view(n, k, d), (full[:, k * d :] if shared is not None else None)

    def _route(self, scores: Tensor, routing: Routing | None) -> tuple[Tensor, Tensor]:
        if isinstance(routing, RoutingReplay) and routing.experts:
            idx, gates = routing.lookup(self.layer)
            idx = idx.to(scores.device)
            if routing.rows is not None:  # rows without a record: the router's own choice
                rows = routing.rows.to(scores.device).unsqueeze(-1)
                own = self._select(scores)
                idx = torch.where(rows, idx, own)
                if gates is not None:
                    own_gates = kernels.routed_gates(scores, own)
                    gates = torch.where(rows, gates.to(scores.device), own_gates)
            if gates is None:
                gates = kernels.routed_gates(scores, idx)
            return idx, gates.to(scores.device)
        idx = self._select(scores)
        gates = kernels.routed_gates(scores, idx)
        if isinstance(routing, RoutingRecorder):
            routing.add(self.layer, idx, gates)
        return idx, gates

    def _select(self, scores: Tensor) -> Tensor:
        """Top-k experts by biased score (the bias picks experts, never weighs them).

        On the Triton path the selection kernel decides (ties to the lower expert id), the
        one the fused inference path runs, so training and inference select alike."""
        if use_triton(scores):
            from rlsys.kernels.triton_ops.moe_route import RANK_MAX, route_fwd

            if self.cfg.n_experts <= RANK_MAX:
                k = self.cfg.experts_per_token
                return route_fwd(scores.detach(), self.expert_bias, k, scores=True)[0]
        biased = scores.detach() + self.expert_bias
        return biased.topk(self.cfg.experts_per_token, dim=-1).indices

    def _run_experts(self, x: Tensor, idx: Tensor, counts: Tensor) -> Tensor:
        """(N, k, d) fp32 subtotals: expert idx[t, j] applied to token t, in slot j."""
        n, k = idx.shape
        if use_triton(x):
            ys, inverse = self._sorted_experts(x, idx, counts)
            return ys.index_select(0, inverse).view(n, k, -1)
        order = stable_argsort(idx.reshape(-1), self.cfg.n_experts)
        ys = self._per_expert(x[order // k], counts.tolist())
        return ys.new_zeros(n * k, ys.shape[-1]).index_copy(0, order, ys).view(n, k, -1)

    def _sorted_experts(self, x: Tensor, idx: Tensor, counts: Tensor) -> tuple[Tensor, Tensor]:
        """The Triton path: (N * k, d) fp32 expert outputs in expert order (stable), and
        the inverse permutation (slot s = t * k + j of the routed rows is row `inverse[s]`)."""
        order, inverse = self._expert_order(idx)
        ys = self._grouped(self._sorted_rows(x, order, inverse, idx), counts)
        return ys, inverse

    def _expert_order(self, idx: Tensor) -> tuple[Tensor, Tensor]:
        """(order, inverse): the routed slots sorted by expert (stable), and where each slot
        went (slot s = t * k + j of the routed rows is sorted row `inverse[s]`)."""
        order = stable_argsort(idx.reshape(-1), self.cfg.n_experts)
        inverse = torch.empty_like(order).scatter_(
            0, order, torch.arange(order.shape[0], device=order.device)
        )
        return order, inverse

    @staticmethod
    def _sorted_rows(x: Tensor, order: Tensor, inverse: Tensor, idx: Tensor) -> Tensor:
        from rlsys.kernels.triton_ops.autograd import SortedRows

        return SortedRows.apply(x, order, inverse, idx.shape[1])

    def _per_expert(self, x_sorted: Tensor, counts: list[int]) -> Tensor:
        """The reference path: every expert's SwiGLU and down projection on its sorted rows,
        all experts in one call per product (`kernels.reference_grouped`: bitwise the
        per-expert `swiglu_hidden` and `row_parallel.partial`)."""
        from rlsys.kernels import reference_grouped as rg

        tiles = rg.ExpertTiles.of(counts, x_sorted.device)
        x = tiles.pad(x_sorted)
        hidden = kernels.silu(rg.grouped_linear(x, self.w1, tiles)) * rg.grouped_linear(
            x, self.w3, tiles
        )
        y = rg.grouped_row_partial(hidden, self.w2, tiles, self.row_parallel.chunks)
        return tiles.unpad(y)

    def _grouped(self, x_sorted: Tensor, counts: Tensor) -> Tensor:
        from rlsys.kernels.triton_ops.autograd import GroupedTree

        hidden, offsets, tiles, empty = self._grouped_hidden(x_sorted, counts)
        chunks = self.row_parallel.chunks
        return GroupedTree.apply(hidden, self.w2, offsets, tiles, chunks, empty)

    def _grouped_hidden(
        self, x_sorted: Tensor, counts: Tensor
    ) -> tuple[Tensor, Tensor, tuple, Tensor]:
        """(the experts' SwiGLU rows, offsets, tile table, empty experts) of sorted rows."""
        from rlsys.kernels.triton_ops.autograd import GroupedSwiGLU
        from rlsys.kernels.triton_ops.expert_plan import expert_plan
        from rlsys.kernels.triton_ops.linear import BM

        max_tiles = -(-x_sorted.shape[0] // BM) + self.cfg.n_experts
        # one launch: the tile table, the offsets (on the device, never read) and the
        # experts whose weight gradients must be exactly 0
        tiles, offsets, empty = expert_plan(counts, max_tiles, BM)
        w13 = self._w13.get([self.w1, self.w3]) if self._caches_stack() else None
        hidden = GroupedSwiGLU.apply(x_sorted, self.w1, self.w3, offsets, tiles, empty, w13)
        return hidden, offsets, tiles, empty

    def _caches_stack(self) -> bool:
        """Whether the grouped SwiGLU reads the cached [w1; w3] (`_w13`) rather than a
        concatenation made per call (two of 64 MB per MoE layer and micro-batch at `large`,
        forward and backward): where the product runs over the stack, and not under FSDP2,
        whose parameters are gathered anew for every forward (`shard_policy` turns it off;
        a cache there would hold a whole unsharded copy). `CACHED_EXPERT_STACK=False`
        concatenates per call, as before. A graphed trunk refreshes the cache before each
        replay (`trunk_graphs`); an eager call's `get` checks on its own."""
        from rlsys.kernels.triton_ops.products import products

        return CACHED_EXPERT_STACK and self.stack_cache and products().stacks_experts(self.w1)

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        # Checkpoints written before the experts were stacked hold experts.{e}.w{1,2,3}.
        for name in ("w1", "w2", "w3"):
            old = [f"{prefix}experts.{e}.{name}" for e in range(self.cfg.n_experts)]
            if old[0] in state_dict and f"{prefix}{name}" not in state_dict:
                state_dict[f"{prefix}{name}"] = torch.stack([state_dict.pop(key) for key in old])
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _balance_loss(self, scores: Tensor, counts: Tensor, routed: int) -> Tensor:
        """Switch-style `E * sum_e f_e * P_e` (f: routed fraction, P: mean router prob)."""
        e = self.cfg.n_experts
        frac = counts.float() / routed
        prob = (scores / scores.sum(-1, keepdim=True)).mean(0)
        return e * (frac.detach() * prob).sum()

    @torch.no_grad()
    def update_balance(self) -> None:
        """Aux-loss-free balancing: nudge the selection bias toward under-loaded experts."""
        # no `load.sum() > 0` test: it would read the device, and with no load every sign is
        # sign(0 - 0) = 0, so the bias is left as it is anyway
        if self.cfg.balance == "bias":
            delta = torch.sign(self.expert_load.mean() - self.expert_load)
            self.expert_bias += self.cfg.balance_bias_rate * delta
        self.expert_load.zero_()


def _expert_counts(idx: Tensor, n_experts: int) -> Tensor:
    """Rows routed to each expert (int64, on idx's device). scatter_add, not bincount:
    CUDA's bincount reads max() back to the host (a sync that would also break CUDA-graph
    capture); integer adds are exact in any order."""
    flat = idx.reshape(-1)
    counts = torch.zeros(n_experts, dtype=torch.int64, device=flat.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat))
