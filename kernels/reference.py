"""Plain-torch reference kernels: every reduction the model performs goes through here.

Invariant (batch invariance): the value computed for one row (a token, a query, a head)
depends only on that row's inputs, never on how many other rows share the call, where the
row sits in it, or what the other rows hold. This is what lets the engine's incremental
decode and the trainer's full-sequence forward agree bitwise (docs/ARCHITECTURE.md,
"Numerics").

How it is obtained, so later kernels keep it:
- Matrix products run as `bmm` over items of a *fixed* shape: rows are padded to
  `ROW_TILE` (and varying columns to `COL_TILE`). BLAS picks its algorithm from the shape
  (a 1-row product takes a gemv path with another summation order), so a fixed item shape
  means one algorithm for every batch; `bmm` results do not depend on the item count.
- Attention works on aligned key blocks. Within a block the reduction has a fixed length;
  across blocks it is a strictly sequential fold (`cumsum` on CPU accumulates in order, in
  double), in ascending absolute block order. Masked entries contribute exact zeros, and
  adding an exact zero to a sequential fold changes nothing, so a query attending over the
  union of a tile's selections gets bitwise the result of attending over its own.
- Row reductions over a fixed length (RMSNorm, log-softmax) reduce each row on its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

ROW_TILE = 32
COL_TILE = 32


def _pad_rows(x: Tensor, multiple: int) -> Tensor:
    pad = (-x.shape[0]) % multiple
    return F.pad(x, (0, 0, 0, pad)) if pad else x


def linear(x: Tensor, w: Tensor) -> Tensor:
    """`x @ w.T` for x (..., K), w (N, K), row-invariant; computed in w's dtype.

    Columns are tiled too (`matmul_nt`): every product is a fixed (ROW_TILE, K) x
    (K, COL_TILE) item, so an output column's value does not depend on N either. A
    column-parallel shard (N / degree columns) then computes the same bits as the full
    matrix; with one (K, N) item per row tile, some BLAS builds (seen on AMD EPYC) pick
    a K blocking by N and the TP shards drifted by 1 ulp.
    """
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k).to(w.dtype)
    return matmul_nt(rows, w).reshape(*lead, w.shape[0])


def matmul_nt(a: Tensor, b: Tensor) -> Tensor:
    """`a @ b.T` for a (M, K), b (N, K) where both M and N vary (e.g. index scores)."""
    m, n, k = a.shape[0], b.shape[0], a.shape[1]
    a_t = _pad_rows(a, ROW_TILE).view(-1, ROW_TILE, k)
    b_t = _pad_rows(b.to(a.dtype), COL_TILE).view(-1, COL_TILE, k)
    mt, nt = a_t.shape[0], b_t.shape[0]
    lhs = a_t.unsqueeze(1).expand(mt, nt, ROW_TILE, k).reshape(-1, ROW_TILE, k)
    rhs = b_t.transpose(1, 2).unsqueeze(0).expand(mt, nt, k, COL_TILE).reshape(-1, k, COL_TILE)
    out = torch.bmm(lhs, rhs).view(mt, nt, ROW_TILE, COL_TILE).permute(0, 2, 1, 3)
    return out.reshape(mt * ROW_TILE, nt * COL_TILE)[:m, :n]


def rms_norm(x: Tensor, gamma: Tensor, eps: float) -> Tensor:
    """Zero-centred RMSNorm `x / rms(x) * (1 + gamma)`, all in fp32; returns fp32."""
    x32 = x.float()
    inv = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return x32 * inv * (1.0 + gamma.float())


def log_softmax(logits: Tensor) -> Tensor:
    """Log-softmax over the last dim in fp32 (each row reduced on its own)."""
    return torch.log_softmax(logits.float(), dim=-1)


def sequential_sum(x: Tensor, dim: int) -> Tensor:
    """Sum along `dim` as an in-order fold: invariant to exact zeros inserted anywhere."""
    return torch.cumsum(x, dim=dim).select(dim, -1)


def block_attention(
    q: Tensor, k: Tensor, v: Tensor, visible: Tensor, scale: float
) -> tuple[Tensor, Tensor]:
    """Attention of item rows over key blocks, folded block by block.

    Shapes (I items, R query rows, U key blocks of S slots, D head dim):
      q (I, R, D), k/v (I, U, S, D), visible (I, R, U, S) bool.
    Blocks must be in ascending absolute order; invisible slots must hold finite values.
    Returns (out (I, R, D) in q's dtype, block_mass (I, R, U) fp32: softmax mass per block).
    A row that sees nothing returns zeros. Each product is a per-block `bmm` item of shape
    (R, D) x (D, S) or (R, S) x (S, D). Callers bound I * U (memory is O(I * U * R * D)).
    """
    i, r, d = q.shape
    u, s = k.shape[1], k.shape[2]
    q_items = q.unsqueeze(1).expand(i, u, r, d).reshape(i * u, r, d)
    scores = torch.bmm(q_items, k.reshape(i * u, s, d).transpose(1, 2)).view(i, u, r, s)
    scores = scores.float().permute(0, 2, 1, 3) * scale  # (I, R, U, S)
    scores = scores.masked_fill(~visible, float("-inf"))
    row_max = scores.amax(dim=(2, 3), keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    p = torch.exp(scores - row_max)  # invisible -> exactly 0
    mass_blocks = p.sum(-1)  # (I, R, U): fixed-length S reduction per block
    denom = sequential_sum(mass_blocks, dim=2)  # (I, R)
    p_items = p.permute(0, 2, 1, 3).reshape(i * u, r, s).to(v.dtype)
    pv = torch.bmm(p_items, v.reshape(i * u, s, d)).view(i, u, r, d)
    num = sequential_sum(pv.float(), dim=1)  # in-order fold: unseen blocks add exact 0
    safe = torch.where(denom > 0, denom, torch.ones_like(denom))
    out = num / safe.unsqueeze(-1)
    return out.to(q.dtype), mass_blocks / safe.unsqueeze(-1)


def moe_combine(expert_out: Tensor, gates: Tensor, shared: Tensor | None) -> Tensor:
    """`shared + sum_j gates[:, j] * expert_out[:, j]` in fp32, folded in slot order j."""
    acc = (
        shared.float()
        if shared is not None
        else expert_out.new_zeros(expert_out.shape[0], expert_out.shape[2], dtype=torch.float32)
    )
    for j in range(expert_out.shape[1]):
        acc = acc + gates[:, j : j + 1].float() * expert_out[:, j].float()
    return acc


def normalize_rows(x: Tensor) -> Tensor:
    """`x / x.sum(-1)` with an in-order fold (used for top-k gate normalisation)."""
    return x / sequential_sum(x, dim=-1).unsqueeze(-1)


def sigmoid(x: Tensor) -> Tensor:
    """`1 / (1 + exp(-x))` in fp32 (returns fp32).

    Why not `torch.sigmoid`: on CPU its vectorised body and scalar tail round differently,
    so an element's value would depend on where it sits in the tensor; `exp` and basic
    arithmetic agree between the two paths.
    """
    return 1.0 / (1.0 + torch.exp(-x.float()))


def silu(x: Tensor) -> Tensor:
    """`x * sigmoid(x)`, position-independent like `sigmoid`; returns x's dtype."""
    x32 = x.float()
    return (x32 * sigmoid(x32)).to(x.dtype)
