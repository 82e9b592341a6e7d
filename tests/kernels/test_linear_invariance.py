"""The products the linear dispatcher picks are batch-invariant at every preset's weight shape.

For every weight of presets `small`, `medium`, `large` and `deep-92` (the model built on the
meta device; each weight with the product the model runs it through: column, SwiGLU pair,
row-parallel tree, routed experts), the product `products()` picks gives, for every M from
1 to `PREFILL`, bitwise the rows it gives in one batch of `PREFILL` rows; beyond that, up
to the trainer's micro-batch, sampled sizes. Row-parallel trees: the subtrees a TP rank of
degree 2, 4 or 8 computes sum to the whole tree bitwise. Routed experts: an expert's rows do
not depend on how many rows the other experts got.

On the GPU this is where cuBLAS's invariance (no workspace, so no split-K) is established
for the shapes the dispatcher sends to it (`products.py`); on the CPU (CI) the same checks
run through Triton's interpreter on `tiny`'s shapes and a few sizes.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable

import pytest
import torch
from torch import Tensor

pytest.importorskip("triton")

from rlsys.config.model import preset  # noqa: E402
from rlsys.kernels.triton_ops.linear import BM, expert_tiles  # noqa: E402
from rlsys.kernels.triton_ops.products import products  # noqa: E402
from rlsys.model import Transformer  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
ALL_PRESETS = "small,medium,large,deep-92" if CUDA else "tiny"
# a subset for a short device call (RLSYS_INVARIANCE_PRESETS=large); all four by default
PRESETS = os.environ.get("RLSYS_INVARIANCE_PRESETS", ALL_PRESETS).split(",")
PREFILL = 16384 if CUDA else 48  # every M from 1 to here
BEYOND = (16385, 24575, 32767, 32768, 65536) if CUDA else (63,)  # trainer micro-batches
MAX_OUT = 2**31  # bytes of one reference output: beyond it the sizes above PREFILL stop
FLOP_BUDGET = 4e15  # per shape: past it the sweep above `DENSE` rows takes a stride
DENSE = 2048
Run = Callable[[Tensor], Tensor]


def _kind(name: str, shape: tuple[int, ...]) -> str | None:
    """The product the model runs weight `name` through (None: not a product)."""
    leaf = name.rsplit(".", 1)[-1]
    if len(shape) == 1 or leaf == "embed":
        return None
    if len(shape) == 3:
        return {"w1": "grouped_swiglu", "w3": None, "w2": "grouped_tree"}[leaf]
    if leaf in ("wo", "w2"):
        return "row_tree"
    if leaf == "w3":
        return None  # with its w1
    return "swiglu" if leaf == "w1" else "column"


def _shapes() -> list[tuple[str, str, tuple[int, ...], torch.dtype]]:
    """(preset, kind, weight shape, dtype), each distinct once."""
    seen: dict[tuple, str] = {}
    for name in PRESETS:
        with torch.device("meta"):
            model = Transformer(preset(name))
        for pname, p in model.named_parameters():
            kind = _kind(re.sub(r"\.\d+\.", ".", pname), tuple(p.shape))
            if kind is not None:
                seen.setdefault((kind, tuple(p.shape), p.dtype), name)
    return [(name, kind, shape, dtype) for (kind, shape, dtype), name in seen.items()]


SHAPES = _shapes()


def _rand(*shape: int, dtype: torch.dtype, seed: int = 0) -> Tensor:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(*shape, device=DEV, generator=gen) * 0.5).to(dtype)


def _one_expert(e: int) -> Callable[[int], tuple[Tensor, tuple]]:
    def offsets_tiles(m: int) -> tuple[Tensor, tuple]:  # every row to expert 0
        counts = torch.zeros(e, dtype=torch.int64, device=DEV)
        counts[0] = m
        return torch.cumsum(counts, 0, dtype=torch.int32), expert_tiles(counts, -(-m // BM) + e)

    return offsets_tiles


def _product(kind: str, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[Run, int]:
    """The dispatcher's product for a weight of `shape` as a function of the rows, and K."""
    p = products()
    w = _rand(*shape, dtype=dtype, seed=1)
    if kind == "column":
        return (lambda x: p.column(x, w)), shape[1]
    if kind == "swiglu":
        w3 = _rand(*shape, dtype=dtype, seed=2)
        return (lambda x: p.swiglu(x, w, w3)), shape[1]
    if kind == "row_tree":
        return (lambda x: p.row_tree(x, w, 8)), shape[1]
    route = _one_expert(shape[0])
    if kind == "grouped_swiglu":
        w3 = _rand(*shape, dtype=dtype, seed=2)
        return (lambda x: p.grouped_swiglu(x, w, w3, *route(x.shape[0]))), shape[2]
    return (lambda x: p.grouped_tree(x, w, *route(x.shape[0]), 8)), shape[2]


def _sizes(n: int, k: int) -> list[int]:
    """Every M up to PREFILL (strided past DENSE rows when a full sweep would cost more than
    FLOP_BUDGET), then the sampled trainer sizes whose output fits MAX_OUT."""
    full = 2.0 * n * k * PREFILL * PREFILL / 2
    stride = max(1, int(full / FLOP_BUDGET + 0.999))
    ms = list(range(1, min(DENSE, PREFILL) + 1)) + list(range(DENSE + 1, PREFILL + 1, stride))
    return ms + [m for m in BEYOND if m * n * 4 <= MAX_OUT]


@pytest.mark.parametrize(
    "name,kind,shape,dtype", SHAPES, ids=[f"{s[0]}-{s[1]}-{s[2]}" for s in SHAPES]
)
def test_rows_do_not_depend_on_the_batch(
    name: str, kind: str, shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    run, k = _product(kind, shape, dtype)
    n = shape[-2] if kind != "grouped_tree" else shape[1]
    ms = _sizes(n, k)
    x = _rand(max(ms), k, dtype=dtype)
    with torch.no_grad():
        ref = run(x)
        differ = torch.stack([(run(x[:m]) != ref[:m]).any() for m in ms])
    bad = [m for m, d in zip(ms, differ.tolist(), strict=True) if d]
    assert not bad, f"{name} {kind} {tuple(shape)} {dtype}: rows differ at M = {bad[:20]}"


ROW_TREES = [s for s in SHAPES if s[1] in ("row_tree", "grouped_tree")]


@pytest.mark.parametrize(
    "name,kind,shape,dtype", ROW_TREES, ids=[f"{s[0]}-{s[1]}-{s[2]}" for s in ROW_TREES]
)
def test_row_parallel_subtrees_sum_to_the_whole_tree(
    name: str, kind: str, shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    w = _rand(*shape, dtype=dtype, seed=1)
    k, p = shape[-1], products()
    route = _one_expert(shape[0])

    def tree(x: Tensor, w: Tensor, chunks: int) -> Tensor:
        if kind == "row_tree":
            return p.row_tree(x, w, chunks)
        return p.grouped_tree(x, w, *route(x.shape[0]), chunks)

    for m in (1, 7, 64, 1000):
        x = _rand(m, k, dtype=dtype, seed=m)
        whole = tree(x, w, 8)
        for degree in (2, 4, 8):
            size = k // degree
            parts = [tree(x[:, r * size : (r + 1) * size], w[..., r * size : (r + 1) * size].contiguous(),
                          8 // degree) for r in range(degree)]  # fmt: skip
            while len(parts) > 1:
                parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
            assert torch.equal(parts[0], whole), f"{name} {shape} degree {degree}, M = {m}"


GROUPED = [s for s in SHAPES if s[1] in ("grouped_swiglu", "grouped_tree")]


@pytest.mark.parametrize(
    "name,kind,shape,dtype", GROUPED, ids=[f"{s[0]}-{s[1]}-{s[2]}" for s in GROUPED]
)
def test_an_experts_rows_do_not_depend_on_the_other_experts(
    name: str, kind: str, shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    e, k = shape[0], shape[2]
    w, w3 = _rand(*shape, dtype=dtype, seed=1), _rand(*shape, dtype=dtype, seed=2)
    p = products()

    def run(x: Tensor, counts: Tensor) -> Tensor:
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        tiles = expert_tiles(counts, -(-x.shape[0] // BM) + e)
        if kind == "grouped_swiglu":
            return p.grouped_swiglu(x, w, w3, offsets, tiles)
        return p.grouped_tree(x, w, offsets, tiles, 8)

    gen = torch.Generator().manual_seed(0)
    for rows in (1, 37, 3000 if CUDA else 90):
        counts = torch.bincount(torch.randint(0, e, (rows,), generator=gen), minlength=e).to(DEV)
        x = _rand(rows, k, dtype=dtype, seed=rows)
        with torch.no_grad():
            out = run(x, counts)
            start = 0
            for expert, c in enumerate(counts.tolist()):
                if c:
                    alone = torch.zeros_like(counts)
                    alone[expert] = c
                    own = run(x[start : start + c], alone)
                    assert torch.equal(own, out[start : start + c]), (
                        f"{name} {shape} expert {expert}"
                    )
                start += c


COLUMNS = [s for s in SHAPES if s[1] in ("column", "swiglu", "grouped_swiglu")]


@pytest.mark.parametrize(
    "name,kind,shape,dtype", COLUMNS, ids=[f"{s[0]}-{s[1]}-{s[2]}" for s in COLUMNS]
)
def test_column_shards_give_the_whole_products_columns(
    name: str, kind: str, shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    """Tensor parallelism splits a column product's N over ranks: a rank's shard of the
    weight must give exactly its columns of the whole product, at every degree."""
    p = products()
    w, w3 = _rand(*shape, dtype=dtype, seed=1), _rand(*shape, dtype=dtype, seed=2)
    n, k = shape[-2], shape[-1]
    route = _one_expert(shape[0])

    def run(x: Tensor, w: Tensor, w3: Tensor) -> Tensor:
        if kind == "column":
            return p.column(x, w)
        if kind == "swiglu":
            return p.swiglu(x, w, w3)
        return p.grouped_swiglu(x, w, w3, *route(x.shape[0]))

    for m in (1, 7, 64, 1000):
        x = _rand(m, k, dtype=dtype, seed=m)
        whole = run(x, w, w3)
        for degree in (2, 4, 8):
            if n % degree or (n // degree) % 8:
                continue
            size = n // degree
            for r in range(degree):
                cols = slice(r * size, (r + 1) * size)
                shard = run(x, w[..., cols, :].contiguous(), w3[..., cols, :].contiguous())
                assert torch.equal(shard, whole[:, cols]), f"{name} {shape} TP {degree} rank {r}"
