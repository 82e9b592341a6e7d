"""The batch-invariant linear's two schedules give the same bits.

`serial` adds a tile's K chunks inside one program; `split` gives every (tile, chunk) a
program and adds the chunk products in a second kernel. Which one runs depends on the
number of rows (decode batches split), so a row's value may only stay the same for every
batch size if the two schedules agree bitwise, for every product the model runs: the
column products, the row-parallel tree, and the grouped (MoE) products.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from rlsys.kernels.triton_ops import linear as lin  # noqa: E402
from rlsys.kernels.triton_ops.linear import (  # noqa: E402
    column_chunks,
    expert_tiles,
    grouped_tree_fwd,
    linear_fwd,
    linear_tree_fwd,
    split_chosen,
    swiglu_fwd,
)

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.bfloat16] if CUDA else [torch.float32]
# (rows, K, N): the interpreter runs small shapes; the GPU a decode batch at `large` width
SHAPES = [(5, 256, 40), (70, 512, 24)] + ([(64, 1024, 1024), (1, 2048, 320)] if CUDA else [])


def _rand(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape).to(dtype).to(DEV)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_column_product_schedules_agree_bitwise(
    shape: tuple[int, int, int], dtype: torch.dtype
) -> None:
    m, k, n = shape
    x, w = _rand(m, k, dtype=dtype), _rand(n, k, dtype=dtype)
    assert column_chunks(k) > 1  # a tree: the split schedule has chunks to spread
    serial = linear_fwd(x, w, schedule="serial")
    assert torch.equal(linear_fwd(x, w, schedule="split"), serial)
    tol = 1e-4 if dtype == torch.float32 else 6e-2
    torch.testing.assert_close(serial.float(), x.float() @ w.float().T, atol=tol * 10, rtol=tol)
    w3 = _rand(n, k, dtype=dtype)
    assert torch.equal(
        swiglu_fwd(x, w, w3, schedule="split"), swiglu_fwd(x, w, w3, schedule="serial")
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_chunks", [2, 4, 8])
def test_row_parallel_tree_schedules_agree_bitwise(n_chunks: int, dtype: torch.dtype) -> None:
    x, w = _rand(33, 256, dtype=dtype), _rand(48, 256, dtype=dtype)
    serial = linear_tree_fwd(x, w, n_chunks, schedule="serial")
    assert torch.equal(linear_tree_fwd(x, w, n_chunks, schedule="split"), serial)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_chunks", [2, 4, 8])
def test_the_trees_other_forms_keep_the_bits(
    n_chunks: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`_tree_halved` (the left half kept in the fp32 output) against `_tree` (every pending
    sum in registers) and the split schedule, dense and grouped (a tile with no rows, one
    with a partial tile)."""
    x, w = _rand(70, 256, dtype=dtype), _rand(48, 256, dtype=dtype)
    e, h, d = 3, 256, 40
    w2 = _rand(e, d, h, dtype=dtype)
    counts = torch.tensor([5, 0, 70], device=DEV)
    hs = _rand(int(counts.sum()), h, dtype=dtype)
    tiles = expert_tiles(counts, 6)
    got = {}
    for form in ("carried", "halved"):
        monkeypatch.setattr(lin, "HALVED_TREES", form == "halved")
        got[form] = (
            linear_tree_fwd(x, w, n_chunks, schedule="serial"),
            grouped_tree_fwd(hs, w2, tiles, n_chunks, schedule="serial"),
        )
    split = (
        linear_tree_fwd(x, w, n_chunks, schedule="split"),
        grouped_tree_fwd(hs, w2, tiles, n_chunks, schedule="split"),
    )
    for a, b, c in zip(got["halved"], got["carried"], split, strict=True):
        assert torch.equal(a, b)
        assert torch.equal(a, c)


@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_expert_schedules_agree_bitwise(dtype: torch.dtype) -> None:
    e, h, d = 4, 64, 256
    w1, w3, w2 = (
        _rand(e, h, d, dtype=dtype),
        _rand(e, h, d, dtype=dtype),
        _rand(e, d, h, dtype=dtype),
    )
    counts = torch.tensor([5, 0, 70, 3], device=DEV)
    x = _rand(int(counts.sum()), d, dtype=dtype)
    tiles = expert_tiles(counts, 10)
    hidden = swiglu_fwd(x, w1, w3, tiles, schedule="serial")
    assert torch.equal(swiglu_fwd(x, w1, w3, tiles, schedule="split"), hidden)
    out = grouped_tree_fwd(hidden, w2, tiles, 8, schedule="serial")
    assert torch.equal(grouped_tree_fwd(hidden, w2, tiles, 8, schedule="split"), out)


def test_a_row_keeps_its_bits_when_the_batch_changes_schedule() -> None:
    """A decode-sized batch (split) and a prefill-sized one (serial) give a row one value."""
    k, n = 256, 64
    w = _rand(n, k, dtype=torch.float32)
    big = _rand(64 * 140, k, dtype=torch.float32) if CUDA else _rand(130, k, dtype=torch.float32)
    device = torch.device(DEV)
    tiles_big = -(-big.shape[0] // 64)  # one column tile: N = 64 <= BN
    if not CUDA:
        big_schedule = "serial"  # the interpreter would take minutes over 140 tiles
    else:
        big_schedule = "auto"
        assert not split_chosen(tiles_big, column_chunks(k), device)
    assert split_chosen(1, column_chunks(k), device)  # one tile: auto splits
    whole = linear_fwd(big, w, schedule=big_schedule)
    one = linear_fwd(big[7:8], w)
    assert torch.equal(one, whole[7:8])


def test_the_tree_width_depends_on_k_alone_and_a_bad_schedule_is_named() -> None:
    assert [column_chunks(k) for k in (32, 96, 128, 256, 512, 1024, 2048, 1000)] == [
        1, 1, 1, 2, 4, 8, 8, 4
    ]  # fmt: skip
    with pytest.raises(ValueError, match="'parallel'"):
        split_chosen(4, 8, torch.device(DEV), "parallel")
    assert not split_chosen(4, 1, torch.device(DEV), "split")  # one chunk: nothing to split


@pytest.mark.parametrize("tile", [(16, 32, 2), (32, 16, 1)])
def test_an_fp32_weights_own_tile_serves_every_path_and_batch(
    tile: tuple[int, int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An fp32 weight's registered tile (`FP32_TILES`: the routers, rows per tile other than
    64) is the one the column product, its split and serial schedules and the decode path's
    unreduced chunk products (`partial_products`) all launch, so a row has one value for
    every batch size and every consumer; a bf16 weight of the same shape keeps the default."""
    bm, bn, warps = tile
    k, n = 512, 24
    cfg = lin.TileConfig(bn=bn, bk=64, warps=warps, stages=2, bm=bm)
    monkeypatch.setitem(lin.FP32_TILES, (n, k), cfg)
    assert lin.tile_for(n, k, torch.float32) is cfg
    assert lin.tile_for(n, k, torch.bfloat16) is lin.DEFAULT_TILE
    w = _rand(n, k, dtype=torch.float32)
    x = _rand(37, k, dtype=torch.bfloat16).float()  # rows spanning several 16-row tiles
    launched: list[int] = []
    real = lin._matmul

    class Spy:  # records the rows per tile of each launch, then launches
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                launched.append(kwargs["BM"])
                return real[grid](*args, **kwargs)

            return run

    monkeypatch.setattr(lin, "_matmul", Spy())
    _assert_one_value_per_row(x, w, row=20)  # one row: its own tile
    assert launched == [bm] * 4


def _assert_one_value_per_row(x: torch.Tensor, w: torch.Tensor, row: int) -> None:
    """The serial and split schedules and the decode path's chunk products give x @ w.T
    bitwise alike, and row `row` alone keeps its value."""
    from rlsys.kernels.triton_ops.partials import partial_products

    serial = linear_fwd(x, w, schedule="serial")
    assert torch.equal(linear_fwd(x, w, schedule="split"), serial)
    assert torch.equal(partial_products(x, w, column_chunks(w.shape[1])).reduced(), serial)
    assert torch.equal(linear_fwd(x[row : row + 1], w), serial[row : row + 1])
    torch.testing.assert_close(serial, x @ w.T, atol=1e-3, rtol=1e-4)


def test_large_routers_product_takes_its_measured_tile() -> None:
    """`large`'s router (fp32, 32 x 1,024) has the tile timed for it, which both its engine
    and its trainer launch (`tile_for` from the weight alone)."""
    from rlsys.config.model import preset

    large = preset("large")
    tile = lin.tile_for(large.n_experts, large.d_model, torch.float32)
    assert tile is not lin.DEFAULT_TILE and (tile.bm, tile.bn, tile.warps) == (16, 16, 1)


@pytest.mark.parametrize("shape", sorted(lin.FP32_TILES))
def test_each_measured_fp32_tile_gives_one_value_per_row(shape: tuple[int, int]) -> None:
    """The table's own tiles (not a test's), at their weight shapes: the serial and split
    schedules and the decode path's chunk products agree bitwise, and a single row keeps
    its value."""
    n, k = shape
    w = _rand(n, k, dtype=torch.float32)
    x = _rand(37, k, dtype=torch.bfloat16).float()
    _assert_one_value_per_row(x, w, row=36)


def test_a_tile_that_tl_dot_cannot_take_is_named() -> None:
    from rlsys.kernels.triton_ops.linear import TileConfig

    with pytest.raises(ValueError, match="bm=8"):
        TileConfig(bm=8)
    with pytest.raises(ValueError, match="bn=48"):
        TileConfig(bn=48)
