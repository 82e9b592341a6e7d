"""The linear dispatcher: which implementation computes each of the model's products, chosen
from the weight's shape and dtype only, never from the number of rows.

Products (`autograd.py` wraps each with its backward):
- `column(x, w)`: x @ w.T in w's dtype (projections, gates, index, LM head, router);
- `swiglu(x, w1, w3)`: silu(x w1^T) * (x w3^T) (dense FFN, shared expert);
- `row_tree(x, w, n_chunks)`: the row-parallel fp32 tree of K-chunk products (attention
  output, FFN down projection), the same bits at every TP degree (`rlsys.kernels.tp`);
- `grouped_swiglu` / `grouped_tree`: the routed experts, rows sorted by expert, with the
  expert offsets (cumulative counts, int32, on the device) and the tile table.

Modes (a registry, process-wide: `RLSYS_LINEAR`, or `linear_mode()` in benchmarks):
- `invariant` (default): cuBLAS where it is batch-invariant, the Triton kernels elsewhere.
  cuBLAS is batch-invariant when it cannot split K over thread blocks: with no workspace
  (`CUBLAS_WORKSPACE_CONFIG=:0:0`, `CUBLASLT_WORKSPACE_SIZE=0`, set by `rlsys.kernels` at
  import, before CUDA starts) and reduced-precision split reductions off, an output element
  is one in-order K loop whatever tile the heuristic picks for M. Measured bitwise for every
  M at every preset's bf16 weight shapes (tests/kernels/test_linear_invariance.py);
  not in fp32 (rows differ at M <= 16) and not at N off a multiple of 8 (so N is padded).
  `torch._grouped_mm` gives an expert's rows bitwise independent of the other experts' rows.
  So, in bf16/fp16: column, swiglu and the routed experts' SwiGLU run on cuBLAS / the grouped
  GEMM (the routed experts' w1 and w3 as one grouped GEMM over their concatenation,
  (E, 2H, K)). The row-parallel trees stay on the Triton kernels: a tree over fp32 chunk partials
  in registers; on cuBLAS each chunk would write and re-read an fp32 (M, N) partial.
  fp32 models run every product on the Triton kernels.
- `triton`: every product on the Triton kernels (the design before this dispatcher).
- `plain`: every product on plain cuBLAS / grouped GEMM, bf16 partials, no tree, no batch
  invariance: the speed ceiling of the invariant design (benchmarks; engine and trainer
  then disagree).

Invariant: the choice for a product depends on (mode, product, N, K, dtype) only, and is
made once per process: `_holds` checks cuBLAS's invariance on this GPU at the first use of a
shape (comparing the rows of a few batch sizes against one large batch); a shape whose rows
differ runs on Triton for the life of the process. Inside a CUDA-graph capture no check can
run: the rule decides and its answer is cached like a check's.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from rlsys.kernels.dispatch import WORKSPACE_ENV
from rlsys.kernels.triton_ops import grouped_decode as gd
from rlsys.kernels.triton_ops import linear as lin
from rlsys.kernels.triton_ops.swiglu import silu_mul

ALIGN = 8  # 16-byte rows in bf16: cuBLAS's aligned (TMA) kernels; other N are padded
PROBE_ROWS = 2048
PROBE_MS = (1, 2, 3, 4, 5, 7, 8, 13, 16, 17, 31, 33, 64, 100, 127, 255, 512, 1000, 2047)


def workspace_off() -> bool:
    """cuBLAS runs without a workspace in this process (the env was set before CUDA)."""
    return all(os.environ.get(k) == v for k, v in WORKSPACE_ENV.items())


def grouped_mm(a: Tensor, b: Tensor, offsets: Tensor) -> Tensor:
    """`torch._grouped_mm` (a, b in one dtype; 2-D x 3-D: rows of a grouped by `offsets`;
    2-D x 2-D: the shared dim grouped, one (E, ., .) product per group)."""
    return torch._grouped_mm(a, b, offs=offsets)


def _pad_rows(w: Tensor) -> Tensor:
    n = w.shape[-2]
    return F.pad(w, (0, 0, 0, (-n) % ALIGN)) if n % ALIGN else w


def cublas_column(x: Tensor, w: Tensor) -> Tensor:
    n = w.shape[0]
    y = F.linear(x.to(w.dtype), _pad_rows(w))
    return y if y.shape[1] == n else y[:, :n].contiguous()


def cublas_swiglu_and_product(
    x: Tensor, w1: Tensor, w3: Tensor, w13: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """silu(x w1^T) * (x w3^T) on cuBLAS, and the product it was made from,
    a13 = x [w1; w3]^T. `w13`: [w1; w3] already concatenated (an inference cache), else
    concatenated here."""
    h = w1.shape[0]
    a13 = cublas_column(x, w13 if w13 is not None else torch.cat([w1, w3]))
    return silu_mul(a13[:, :h], a13[:, h:]), a13


def cublas_grouped_swiglu(
    x: Tensor, w1: Tensor, w3: Tensor, offsets: Tensor, w13: Tensor | None = None
) -> Tensor:
    """One grouped GEMM over every expert's [w1; w3] (E, 2H, K), then SwiGLU over its halves.
    `w13`: that concatenation already made (an inference cache), else made here; the
    product is over the same values either way, so the bits are the same."""
    return cublas_grouped_swiglu_and_product(x, w1, w3, offsets, w13)[0]


def cublas_grouped_swiglu_and_product(
    x: Tensor, w1: Tensor, w3: Tensor, offsets: Tensor, w13: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """`cublas_grouped_swiglu`'s value and its grouped product a13 (rows, 2H)."""
    h = w1.shape[1]
    stacked = w13 if w13 is not None else torch.cat([w1, w3], dim=1)
    a13 = grouped_mm(x.to(w1.dtype), stacked.transpose(1, 2), offsets)
    return silu_mul(a13[:, :h], a13[:, h:]), a13


_checked: dict[tuple, bool] = {}


def _rows_agree(
    run: Callable[[Tensor], Tensor], k: int, dtype: torch.dtype, dev: torch.device
) -> bool:
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(PROBE_ROWS, k, device=dev, generator=gen).to(dtype)
    full = run(x)
    bad = torch.zeros((), dtype=torch.bool, device=dev)
    for m in PROBE_MS:
        bad |= (run(x[:m]) != full[:m]).any()
    return not bool(bad)


def _holds(kind: str, shape: tuple[int, ...], dtype: torch.dtype, dev: torch.device) -> bool:
    """Whether cuBLAS's `kind` product ("column" or "grouped") is batch-invariant for a
    weight of `shape` (cached per process; see the module doc)."""
    key = (kind, shape, dtype, dev)
    if key not in _checked:
        ok = dev.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and workspace_off()
        ok = ok and shape[-1] % ALIGN == 0
        if ok:  # split reductions in bf16/fp16 in the output buffer need no workspace
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
            torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
        if ok and not torch.cuda.is_current_stream_capturing():
            gen = torch.Generator(device=dev).manual_seed(1)
            probe = torch.randn(shape, device=dev, generator=gen).to(dtype)
            with torch.no_grad():
                ok = _rows_agree(_PROBES[kind](probe), shape[-1], dtype, dev)
        _checked[key] = ok
    return _checked[key]


def _expert_probe(weight: Tensor, seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Random experts shaped like `weight` (E, N, K), rows per expert as
    `grouped_decode.check_counts` gives: (weights, counts, offsets int32, rows sorted by
    expert (rows, K))."""
    dev, (e, _n, k) = weight.device, weight.shape
    gen = torch.Generator(device=dev).manual_seed(seed)
    w = (torch.randn(weight.shape, device=dev, generator=gen) * 0.05).to(weight.dtype)
    counts = gd.check_counts(e).to(dev)
    x = torch.randn(int(counts.sum()), k, device=dev, generator=gen).to(weight.dtype)
    return w, counts, torch.cumsum(counts, 0).to(torch.int32), x


def _unchecked_in_capture(key: tuple, t: Tensor) -> bool:
    """No check can run inside a CUDA-graph capture: an unchecked shape keeps the general
    kernel there (the engine's graphs run an eager warm-up forward first, which checks)."""
    return key not in _checked and t.is_cuda and torch.cuda.is_current_stream_capturing()


def _decode_swiglu_holds(w13: Tensor) -> bool:
    """Whether the decode kernel (`grouped_decode.grouped_swiglu_rows`) gives the grouped
    GEMM + `silu_mul`'s bits for experts of this shape on this GPU: checked once per
    process on random rows (experts with 0, 1, 16, 17 and more rows)."""
    key = ("decode_swiglu", tuple(w13.shape), w13.dtype, w13.device)
    if _unchecked_in_capture(key, w13):
        return False
    if key not in _checked:
        ok = w13.is_cuda and gd.fits(w13)
        if ok:
            w, _counts, offsets, x = _expert_probe(w13, 2)
            h = w13.shape[1] // 2
            with torch.no_grad():
                want = cublas_grouped_swiglu(x, w[:, :h], w[:, h:], offsets, w)
                ok = torch.equal(gd.grouped_swiglu_rows(x, w, offsets), want)
        _checked[key] = ok
    return _checked[key]


def decode_tree_holds(w2: Tensor, n_chunks: int) -> bool:
    """Whether the decode kernel (`grouped_decode.grouped_tree_rows`) gives the grouped tree
    kernel's bits for experts of this shape on this GPU. It runs the same `_tree` with the
    operands' roles swapped (the MMA computes the transposed tile), so this holds when the
    MMA's sums do not depend on which operand is which; checked once per process like
    `_decode_swiglu_holds` (under the interpreter both are exact, so it holds there)."""
    key = ("decode_tree", tuple(w2.shape), w2.dtype, w2.device, n_chunks)
    if _unchecked_in_capture(key, w2):
        return False
    if key not in _checked:
        w, counts, offsets, h = _expert_probe(w2, 3)
        tiles = lin.expert_tiles(counts, -(-h.shape[0] // lin.BM) + w2.shape[0])
        with torch.no_grad():
            want = lin.grouped_tree_fwd(h, w, tiles, n_chunks)
            _checked[key] = torch.equal(gd.grouped_tree_rows(h, w, offsets, n_chunks), want)
    return _checked[key]


def _column_probe(w: Tensor) -> Callable[[Tensor], Tensor]:
    return lambda x: cublas_column(x, w)


def _grouped_probe(w: Tensor) -> Callable[[Tensor], Tensor]:
    def run(x: Tensor) -> Tensor:  # every row to the first expert
        offs = torch.full((w.shape[0],), x.shape[0], dtype=torch.int32, device=x.device)
        return grouped_mm(x, w.transpose(1, 2), offs)

    return run


_PROBES: dict[str, Callable[[Tensor], Callable[[Tensor], Tensor]]] = {
    "column": _column_probe,
    "grouped": _grouped_probe,
}


class TritonProducts:
    """Every product on the batch-invariant Triton kernels (`linear.py`)."""

    def column(self, x: Tensor, w: Tensor) -> Tensor:
        return lin.linear_fwd(x, w)

    def swiglu(self, x: Tensor, w1: Tensor, w3: Tensor, w13: Tensor | None = None) -> Tensor:
        """`w13`: [w1; w3], where the caller holds it concatenated (products over it need
        no per-call concatenation); the same values, so the same bits."""
        return self.swiglu_and_product(x, w1, w3, w13)[0]

    def swiglu_and_product(
        self, x: Tensor, w1: Tensor, w3: Tensor, w13: Tensor | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """`swiglu`'s value and, where this implementation makes it, the product
        a13 = x [w1; w3]^T it came from (a backward may keep it rather than recompute it);
        None where the product never exists whole (the Triton tree applies SwiGLU to its
        accumulators). A mode overrides this one, not `swiglu`."""
        return lin.swiglu_fwd(x, w1, w3), None

    def row_tree(self, x: Tensor, w: Tensor, n_chunks: int) -> Tensor:
        return lin.linear_tree_fwd(x, w, n_chunks)

    def grouped_swiglu(
        self,
        x: Tensor,
        w1: Tensor,
        w3: Tensor,
        offsets: Tensor,
        tiles: tuple,
        w13: Tensor | None = None,
    ) -> Tensor:
        """`w13`: every expert's [w1; w3] (E, 2H, K) where the caller caches it."""
        return self.grouped_swiglu_and_product(x, w1, w3, offsets, tiles, w13)[0]

    def grouped_swiglu_and_product(
        self,
        x: Tensor,
        w1: Tensor,
        w3: Tensor,
        offsets: Tensor,
        tiles: tuple,
        w13: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """`grouped_swiglu`'s value and its product a13 where it exists (`swiglu_and_product`;
        a mode overrides this one, not `grouped_swiglu`)."""
        return lin.swiglu_fwd(x, w1, w3, tiles), None

    def stacks_experts(self, w1: Tensor) -> bool:
        """Whether `grouped_swiglu` reads the experts' [w1; w3] concatenation (so a caller's
        cached `w13` saves a copy; elsewhere the cache would be memory for nothing)."""
        return False

    def grouped_tree(
        self, h: Tensor, w2: Tensor, offsets: Tensor, tiles: tuple, n_chunks: int
    ) -> Tensor:
        return lin.grouped_tree_fwd(h, w2, tiles, n_chunks)

    def decode_swiglu(self, w13: Tensor | None, rows: int) -> bool:
        """Whether `rows` routed rows' SwiGLU may run on the decode kernel
        (`grouped_decode.grouped_swiglu_rows`, reading the tokens through the routing's
        order) instead of `grouped_swiglu`: where it gives that product's bits. Not here:
        this mode's product is the Triton tree, whose chunks the decode kernel does not
        follow."""
        return False


class InvariantProducts(TritonProducts):
    """cuBLAS where `_holds`, the Triton kernels elsewhere (see the module doc)."""

    def column(self, x: Tensor, w: Tensor) -> Tensor:
        if _holds("column", tuple(w.shape), w.dtype, w.device):
            return cublas_column(x, w)
        return super().column(x, w)

    def swiglu_and_product(
        self, x: Tensor, w1: Tensor, w3: Tensor, w13: Tensor | None = None
    ) -> tuple[Tensor, Tensor | None]:
        if _holds("column", (2 * w1.shape[0], w1.shape[1]), w1.dtype, w1.device):
            return cublas_swiglu_and_product(x, w1, w3, w13)
        return super().swiglu_and_product(x, w1, w3)

    def grouped_swiglu_and_product(
        self,
        x: Tensor,
        w1: Tensor,
        w3: Tensor,
        offsets: Tensor,
        tiles: tuple,
        w13: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        if self.stacks_experts(w1):
            return cublas_grouped_swiglu_and_product(x, w1, w3, offsets, w13)
        return super().grouped_swiglu_and_product(x, w1, w3, offsets, tiles)

    def stacks_experts(self, w1: Tensor) -> bool:
        e, h, k = w1.shape
        return _holds("grouped", (e, 2 * h, k), w1.dtype, w1.device)

    def decode_swiglu(self, w13: Tensor | None, rows: int) -> bool:
        """Decode-sized rows, the grouped GEMM in use (`w13`: its cached operand) and the
        decode kernel bitwise it on this GPU (`_decode_swiglu_holds`)."""
        return w13 is not None and gd.decode_sized(rows) and _decode_swiglu_holds(w13)


class PlainProducts(TritonProducts):
    """Plain cuBLAS / grouped GEMM for every product: no tree, no invariance (a ceiling)."""

    def column(self, x: Tensor, w: Tensor) -> Tensor:
        return F.linear(x.to(w.dtype), w)

    def swiglu_and_product(
        self, x: Tensor, w1: Tensor, w3: Tensor, w13: Tensor | None = None
    ) -> tuple[Tensor, Tensor | None]:
        return cublas_swiglu_and_product(x, w1, w3, w13)

    def row_tree(self, x: Tensor, w: Tensor, n_chunks: int) -> Tensor:
        return F.linear(x.to(w.dtype), w).float()

    def grouped_swiglu_and_product(
        self,
        x: Tensor,
        w1: Tensor,
        w3: Tensor,
        offsets: Tensor,
        tiles: tuple,
        w13: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        return cublas_grouped_swiglu_and_product(x, w1, w3, offsets, w13)

    def stacks_experts(self, w1: Tensor) -> bool:
        return True

    def grouped_tree(
        self, h: Tensor, w2: Tensor, offsets: Tensor, tiles: tuple, n_chunks: int
    ) -> Tensor:
        return grouped_mm(h.to(w2.dtype), w2.transpose(1, 2), offsets).float()


MODES: dict[str, TritonProducts] = {
    "invariant": InvariantProducts(),
    "triton": TritonProducts(),
    "plain": PlainProducts(),
}
_mode = os.environ.get("RLSYS_LINEAR", "invariant")


def _check_mode(name: str) -> str:
    if name not in MODES:
        raise ValueError(f"linear mode {name!r} (RLSYS_LINEAR): expected one of {sorted(MODES)}")
    return name


def products() -> TritonProducts:
    """The implementations of the current mode."""
    return MODES[_check_mode(_mode)]


@contextlib.contextmanager
def linear_mode(name: str) -> Iterator[None]:
    """Run the products of mode `name` inside the block (benchmarks and tests)."""
    global _mode
    saved, _mode = _mode, _check_mode(name)
    try:
        yield
    finally:
        _mode = saved
