"""Products over concatenated weights: one launch where each part would take its own.

`fused_product(x, parts, cache)` is `x @ [w_a; w_b; ...].T`, each part starting at a row
that is a multiple of `align`, zero rows between. Every path computes it over the same
concatenation, so engine and trainer run a product of the same shape (whatever the linear
picks for that shape, both pick it):
- with autograd (training): `torch.cat` of the parameters, differentiable, every call;
- without (inference, the trainer's no-grad forwards): a cached copy (`FusedWeight`), the
  same values, refreshed when a part changes.

`FusedWeight.get(parts)` returns the concatenation, rebuilt (in place, same storage) when any
part changed since the last call: a weight update (`load_state_dict` copies in place), an
optimiser step, a move to another device or a re-assigned parameter. Every use checks;
CUDA graphs read the buffer captured at warm-up, so the engine calls `refresh` before each
replay (`rlsys.engine.decode_graphs`), and a capture never rebuilds (it would record the
copy into the graph).
"""

from __future__ import annotations

import torch
from torch import Tensor


def fuse_rows(parts: list[Tensor], align: int, dim: int = 0) -> tuple[Tensor, list[int]]:
    """The concatenation along `dim` (differentiable) and each part's first row there."""
    offsets, rows, pieces = [], 0, []
    for p in parts:
        start = -(-rows // align) * align
        if start > rows:
            gap = list(p.shape)
            gap[dim] = start - rows
            pieces.append(p.new_zeros(gap))
        offsets.append(start)
        pieces.append(p)
        rows = start + p.shape[dim]
    return torch.cat(pieces, dim=dim), offsets


def fused_product(x: Tensor, parts: list[Tensor], cache: FusedWeight) -> tuple[Tensor, list[int]]:
    """x @ concat(parts).T (see module doc) and each part's first column."""
    from rlsys import kernels
    from rlsys.kernels.fused import needs_grad

    if needs_grad(x, *parts):
        weight, offsets = fuse_rows(parts, cache.align)
    else:
        weight, offsets = cache.get(parts), cache.offsets
    return kernels.linear(x, weight), offsets


def fused_partials(x: Tensor, parts: list[Tensor], cache: FusedWeight) -> tuple[object, list[int]]:
    """`fused_product` for inference on the Triton path: the product's unreduced chunk
    products (`triton_ops.partials`: the consumer sums them as `linear` would) where the
    dispatcher runs this product on the Triton kernels, else the product itself."""
    from rlsys import kernels
    from rlsys.kernels.fused import partials_ok

    weight = cache.get(parts)
    if partials_ok(x):
        from rlsys.kernels.triton_ops.linear import column_chunks
        from rlsys.kernels.triton_ops.partials import partial_products, triton_computes

        if triton_computes("column", weight):
            return partial_products(x, weight, column_chunks(x.shape[1])), cache.offsets
    return kernels.linear(x, weight), cache.offsets


def _key(parts: list[Tensor]) -> tuple:
    # a new dtype, device or shape is new storage: (object, storage, in-place writes) covers all
    return tuple((id(p), p.data_ptr(), p._version) for p in parts)


class FusedWeight:
    """The row concatenation of some parameters, each at a multiple of `align` (see module
    doc), along `dim` (1 for stacked experts' (E, rows, K) weights). Holds no reference to
    the parameters: a deep copy of the model rebuilds it."""

    def __init__(self, align: int, dim: int = 0) -> None:
        self.align, self.dim = align, dim
        self.buffer: Tensor | None = None
        self.key: tuple | None = None
        self.offsets: list[int] = []  # first row of each part

    def get(self, parts: list[Tensor]) -> Tensor:
        key = _key(parts)
        if self.buffer is not None and key == self.key:
            return self.buffer
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("fused weights changed during a CUDA-graph capture")
        with torch.inference_mode(False), torch.no_grad():
            weight, offsets = fuse_rows([p.detach() for p in parts], self.align, self.dim)
            buf = self.buffer
            if (
                buf is None
                or buf.shape != weight.shape
                or buf.dtype != weight.dtype
                or (buf.device != weight.device)
            ):
                buf = weight
            else:
                buf.copy_(weight)  # the same storage: CUDA graphs captured it
        self.buffer, self.offsets = buf, offsets
        self.key = _key(parts)
        return buf

    def refresh(self, parts: list[Tensor]) -> None:
        """Bring an existing buffer up to date (a no-op before the first use)."""
        if self.buffer is not None:
            self.get(parts)
