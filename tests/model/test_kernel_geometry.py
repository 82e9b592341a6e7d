"""The attention kernels' geometry: which query tile a call's programs take.

Prefill calls and the trainer's packed forward take the wide prefill tile, decode calls the
decode tile (`KernelGeometry.tile_for`); that this changes no token's bits is
`test_triton_attention.py::test_a_token_is_bitwise_the_same_under_any_query_tile`.
"""

from __future__ import annotations

import pytest

from rlsys.config.model import preset
from rlsys.model import kv_layout
from rlsys.model.attention import SeqSpan
from rlsys.model.kv_layout import MMA_ROWS, geometry, packed_kv


@pytest.fixture
def wide_prefill(monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefill tile at twice the decode tile's rows (whatever the default is)."""
    monkeypatch.setattr(kv_layout, "PREFILL_MMA_ROWS", 2 * MMA_ROWS)


def test_the_tiles_hold_their_mma_rows_for_every_preset() -> None:
    for name in ("tiny", "small", "medium", "large", "deep-92"):
        cfg = preset(name)
        geo = geometry(cfg)
        g = cfg.n_heads // cfg.n_kv_groups
        assert geo.query_tile * g == MMA_ROWS, name
        assert geo.prefill_tile * g == kv_layout.PREFILL_MMA_ROWS, name


@pytest.mark.usefixtures("wide_prefill")
def test_a_call_takes_the_prefill_tile_only_when_a_span_fills_it() -> None:
    geo = geometry(preset("large"))
    t, wide = geo.query_tile, geo.prefill_tile
    assert wide == 2 * t
    assert geo.tile_for([1] * 64) == t  # a decode step of any batch
    assert geo.tile_for([wide - 1, 1]) == t
    assert geo.tile_for([wide, 1, 1]) == wide  # a chunk of prefill beside decode rows
    assert geo.tile_for([]) == t


@pytest.mark.usefixtures("wide_prefill")
def test_the_trainers_packed_forward_runs_on_the_prefill_tile() -> None:
    cfg = preset("tiny")
    geo = geometry(cfg)
    long = packed_kv(cfg, [SeqSpan(0, 200, 0), SeqSpan(200, 9, 0)], "cpu")
    assert long.tiles.T == geo.prefill_tile
    short = packed_kv(cfg, [SeqSpan(0, geo.prefill_tile - 1, 0)], "cpu")
    assert short.tiles.T == geo.query_tile


@pytest.mark.parametrize("heads", [3, 5])
def test_heads_per_group_that_do_not_divide_the_tile_are_refused(heads: int) -> None:
    cfg = preset("tiny").with_overrides({"n_heads": heads, "n_kv_groups": 1})
    with pytest.raises(ValueError, match="heads per KV group"):
        geometry(cfg)
