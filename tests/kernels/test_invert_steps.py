"""The Sparse GQA backward's inverse lists (`attention_bwd._invert_steps`): for every
(key chunk of `per` steps, group), the query tiles whose union list visits it, ascending and
each once (a tile visiting several steps of a wide chunk too), from a CSR whose
id buffer is longer than its total (as `union_steps` sizes it, with garbage past the end),
and on a GPU without a device sync (a sync per layer drained the trainer's queue)."""

from __future__ import annotations

import pytest
import torch

from rlsys.kernels.attention_plan import Span, plan_tiles
from rlsys.kernels.triton_ops.attention_bwd import _invert_steps, _key_chunks

CUDA = torch.cuda.is_available()
T, STEP = 4, 8


def _case(seed: int, device: str, per: int = 1) -> tuple:
    g = torch.Generator().manual_seed(seed)
    hkv = int(torch.randint(1, 5, (1,), generator=g))
    lengths = torch.randint(1, 120, (int(torch.randint(1, 4, (1,), generator=g)),), generator=g)
    spans, row = [], 0
    for s, n in enumerate(lengths.tolist()):
        spans.append(Span(s, row, n, 0))
        row += n
    tiles = plan_tiles(spans, T, device)
    chunks = _key_chunks(lengths.tolist(), tiles, STEP * per, torch.device(device))
    offsets, ids, lists = [0], [], {}
    for t in range(tiles.n_tiles):
        reach = (int(tiles.hi[t]) - 1) // STEP + 1
        for grp in range(hkv):
            n_pick = int(torch.randint(0, reach + 1, (1,), generator=g))
            picked = sorted(torch.randperm(reach, generator=g)[:n_pick].tolist())
            lists[(t, grp)] = picked
            ids += picked
            offsets.append(len(ids))
    garbage = torch.randint(-(2**31), 2**31 - 1, (int(torch.randint(0, 30, (1,), generator=g)),))
    step_off = torch.tensor(offsets, dtype=torch.int32, device=device)
    step_ids = torch.cat([torch.tensor(ids, dtype=torch.int32), garbage.to(torch.int32)])
    return hkv, tiles, chunks, step_off, step_ids.to(device), lists


def _expected(hkv: int, tiles, chunks: dict, lists: dict, per: int = 1) -> dict:  # noqa: ANN001
    chunk0 = chunks["chunk0"].cpu()
    seq = tiles.seq.cpu()
    inverse: dict[int, list[int]] = {}
    for (t, grp), steps in sorted(lists.items()):
        for c in steps:
            key = (int(chunk0[int(seq[t])]) + c // per) * hkv + grp
            if t not in inverse.setdefault(key, []):
                inverse[key].append(t)
    return inverse


def _assert_inverse(
    inv_off: torch.Tensor, inv_tiles: torch.Tensor, want: dict, n_keys: int
) -> None:
    for key in range(n_keys):
        got = inv_tiles[int(inv_off[key]) : int(inv_off[key + 1])].tolist()
        assert got == want.get(key, []), key


@pytest.mark.parametrize("per", [1, 2, 4], ids=["step", "2-steps", "4-steps"])
@pytest.mark.parametrize("seed", range(12))
def test_inverse_lists_hold_each_visiting_tile_once_ascending(seed: int, per: int) -> None:
    hkv, tiles, chunks, step_off, step_ids, lists = _case(seed, "cpu", per)
    inv_off, inv_tiles = _invert_steps(step_off, step_ids, tiles, chunks, hkv, per)
    assert inv_off.shape[0] == chunks["n"] * hkv + 1 and int(inv_off[0]) == 0
    want = _expected(hkv, tiles, chunks, lists, per)
    _assert_inverse(inv_off, inv_tiles, want, chunks["n"] * hkv)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("per", [1, 4], ids=["step", "4-steps"])
def test_inverse_lists_are_built_without_a_device_sync(per: int) -> None:
    hkv, tiles, chunks, step_off, step_ids, lists = _case(3, "cuda", per)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        inv_off, inv_tiles = _invert_steps(step_off, step_ids, tiles, chunks, hkv, per)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = _expected(hkv, tiles, chunks, lists, per)
    _assert_inverse(inv_off, inv_tiles, want, chunks["n"] * hkv)
