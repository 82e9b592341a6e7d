"""The grouped products' plan (tile table, offsets, experts without rows) in one launch:
the same integers as the torch form it replaced, surplus tiles included. CPU through
Triton's interpreter; compiled on a GPU (`scripts/device_run.sh tests`)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from rlsys.kernels.triton_ops.expert_plan import (  # noqa: E402
    TILE_CHUNK,
    ZERO_BLOCK,
    expert_plan,
    zero_empty_experts,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BM = 64


def expert_tiles_reference(
    counts: torch.Tensor, max_tiles: int, bm: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tile table in torch ops: the form `expert_plan` replaced (the oracle)."""
    dev = counts.device
    per_expert = (counts + bm - 1) // bm
    tile_end = torch.cumsum(per_expert, 0)  # first tile of the next expert
    first_row = torch.cumsum(counts, 0) - counts
    idx = torch.arange(max_tiles, device=dev)
    expert = torch.searchsorted(tile_end, idx, right=True).clamp_max(counts.shape[0] - 1)
    j = idx - (tile_end - per_expert)[expert]
    rows = torch.clamp(counts[expert] - j * bm, min=0, max=bm)
    rows = torch.where(idx < tile_end[-1], rows, 0)
    row0 = first_row[expert] + j * bm
    return expert.to(torch.int32), row0.to(torch.int32), rows.to(torch.int32)


@pytest.mark.parametrize(
    "counts",
    [
        [0, 0, 0],  # nothing routed: every tile surplus
        [1],  # one expert, one row
        [64, 0, 65, 1, 0, 128],  # exact tiles, empties between, a row past a tile
        [0, 0, 0, 0, 0, 0, 0, 300],  # all rows to the last expert
        [3, 7, 200, 0, 64, 63, 129],  # an odd expert count (padded to a power of two)
    ],
)
def test_the_plan_is_the_torch_form_s_integers(counts: list[int]) -> None:
    c = torch.tensor(counts, dtype=torch.int64, device=DEV)
    max_tiles = -(-sum(counts) // BM) + len(counts)
    tiles, offsets, empty = expert_plan(c, max_tiles, BM)
    want = expert_tiles_reference(c, max_tiles, BM)
    for got_t, want_t in zip(tiles, want, strict=True):
        assert torch.equal(got_t.cpu(), want_t.cpu())
    assert torch.equal(offsets.cpu(), torch.cumsum(c, 0).to(torch.int32).cpu())
    assert torch.equal(empty.cpu(), (c == 0).cpu())


def test_a_table_longer_than_one_walk_step_is_filled_to_its_end() -> None:
    g = torch.Generator().manual_seed(3)
    c = torch.randint(0, 200, (32,), generator=g)
    c[5] = 0
    max_tiles = -(-int(c.sum()) // BM) + 32 + 2 * TILE_CHUNK  # surplus over several steps
    tiles, _, _ = expert_plan(c.to(DEV), max_tiles, BM)
    want = expert_tiles_reference(c, max_tiles, BM)
    for got_t, want_t in zip(tiles, want, strict=True):
        assert torch.equal(got_t.cpu(), want_t)


def test_the_plan_compiles_for_sm90() -> None:
    # the interpreter never lowers the bool store or the int64 count load: compile them
    # offline as a GPU launch would (Triton's own toolchain; nothing is launched)
    from rlsys.kernels.triton_ops.offline import compile_resources

    types = {
        "COUNTS": "*i64", "T_EXPERT": "*i32", "T_ROW0": "*i32", "T_ROWS": "*i32",
        "OFFSETS": "*i32", "EMPTY": "*i1", "E": "i32", "max_tiles": "i32",
    }  # fmt: skip
    used = compile_resources(
        "rlsys.kernels.triton_ops.expert_plan:_expert_plan",
        types,
        {"EP": 32, "CH": TILE_CHUNK, "BM": BM},
        {"num_warps": 4, "num_stages": 3},
    )
    assert used.stack == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_only_the_empty_experts_gradients_become_zero(dtype: torch.dtype) -> None:
    # a slice of several stores per program, and one that does not fill its last store
    grads = torch.randn(5, 3, 2 * ZERO_BLOCK + 7, generator=torch.Generator().manual_seed(0))
    grads = grads.to(dtype).to(DEV)
    before = grads.clone()
    empty = torch.tensor([False, True, False, False, True], device=DEV)
    out = zero_empty_experts(grads, empty)
    assert out.data_ptr() == grads.data_ptr()  # in place
    assert torch.equal(out, before.masked_fill(empty[:, None, None], 0.0))
    assert int((out[1] != 0).sum()) == 0 and int((out[4] != 0).sum()) == 0
