"""Sparse GQA and gated SWA against independent dense implementations."""

from __future__ import annotations

import pytest
import torch

from rlsys.config.model import preset
from rlsys.model.attention import SeqSpan
from rlsys.model.sparse_gqa import SparseGQA
from rlsys.model.swa import GatedSlidingWindowAttention
from tests.model import dense_reference as ref

pytestmark = pytest.mark.unit
LENGTH = 37


def run_layer(layer, x: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    cache = layer.new_cache(torch.float32, x.device)
    with torch.no_grad():
        return layer(x, torch.arange(x.shape[0]), [SeqSpan(0, x.shape[0], 0)], [cache])


def sparse_layer(**overrides) -> SparseGQA:  # type: ignore[no-untyped-def]
    cfg = preset("tiny").with_overrides({"init_std": 0.3, **overrides})
    return SparseGQA(cfg, torch.float32)


def test_sparse_gqa_with_k_covering_the_sequence_equals_dense_causal_gqa() -> None:
    layer = sparse_layer(sparse_block=4, sparse_topk=64, sparse_query_tile=8)
    x = torch.randn(LENGTH, layer.cfg.d_model)
    expected = ref.layer_output(layer, x, ref.causal)
    torch.testing.assert_close(run_layer(layer, x), expected, atol=2e-5, rtol=1e-4)


def test_sparse_gqa_with_block_size_one_equals_token_level_topk() -> None:
    layer = sparse_layer(sparse_block=1, sparse_topk=5, sparse_query_tile=4)
    x = torch.randn(LENGTH, layer.cfg.d_model)
    expected = ref.layer_output(layer, x, ref.token_topk_allowed(layer, x))
    dense = ref.layer_output(layer, x, ref.causal)
    got = run_layer(layer, x)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
    assert (got - dense).abs().max() > 1e-3  # the selection really drops keys


def test_sparse_gqa_block_selection_matches_per_query_reference() -> None:
    layer = sparse_layer()  # B=2, k=8 (4 blocks), tiles of 4 queries
    x = torch.randn(LENGTH, layer.cfg.d_model)
    expected = ref.layer_output(layer, x, ref.sparse_allowed(layer, x))
    torch.testing.assert_close(run_layer(layer, x), expected, atol=2e-5, rtol=1e-4)


def test_union_tiled_prefill_equals_per_query_computation_bitwise() -> None:
    layer = sparse_layer()
    cfg = layer.cfg
    x = torch.randn(LENGTH, cfg.d_model)
    chosen = ref.block_topk_selection(layer, x)
    tile = cfg.sparse_query_tile
    widened = any(
        len({b for t in range(t0, min(t0 + tile, LENGTH)) for b in chosen[t, g]})
        > len(chosen[t0, g])
        for t0 in range(0, LENGTH, tile)
        for g in range(cfg.n_kv_groups)
    )
    assert widened, "the test needs tiles whose union is wider than a single query's choice"
    tiled = run_layer(layer, x)
    cache = layer.new_cache(torch.float32, x.device)
    with torch.no_grad():
        one_by_one = torch.cat(
            [
                layer(x[t : t + 1], torch.tensor([t]), [SeqSpan(0, 1, t)], [cache])
                for t in range(LENGTH)
            ]
        )
    assert torch.equal(tiled, one_by_one)


@pytest.mark.parametrize("window,tile", [(12, 4), (5, 4), (1, 2), (7, 3)])
def test_swa_equals_masked_dense_attention(window: int, tile: int) -> None:
    cfg = preset("tiny").with_overrides({"init_std": 0.3, "swa_window": window, "swa_tile": tile})
    layer = GatedSlidingWindowAttention(cfg, torch.float32)
    x = torch.randn(LENGTH, cfg.d_model)
    expected = ref.layer_output(layer, x, ref.sliding(window))
    torch.testing.assert_close(run_layer(layer, x), expected, atol=2e-5, rtol=1e-4)


def test_swa_cache_stays_window_bounded() -> None:
    cfg = preset("tiny")
    layer = GatedSlidingWindowAttention(cfg, torch.float32)
    cache = layer.new_cache(torch.float32, torch.device("cpu"))
    bound = cfg.swa_blocks_per_tile * cfg.swa_tile
    with torch.no_grad():
        for t in range(50):
            layer(torch.randn(1, cfg.d_model), torch.tensor([t]), [SeqSpan(0, 1, t)], [cache])
            assert cache.k.shape[0] <= bound
    assert cache.start > 0


def test_sparse_gqa_gradients_match_dense_attention_through_checkpointed_tiles() -> None:
    layer = sparse_layer(sparse_block=4, sparse_topk=64, sparse_query_tile=8, tiles_per_chunk=2)
    x = torch.randn(LENGTH, layer.cfg.d_model, requires_grad=True)
    cache = layer.new_cache(torch.float32, x.device)
    got = layer(x, torch.arange(LENGTH), [SeqSpan(0, LENGTH, 0)], [cache])
    (grad_got,) = torch.autograd.grad(got.square().sum(), x)
    x_ref = x.detach().requires_grad_()
    (grad_ref,) = torch.autograd.grad(
        ref.layer_output(layer, x_ref, ref.causal).square().sum(), x_ref
    )
    torch.testing.assert_close(grad_got, grad_ref, atol=1e-4, rtol=1e-3)


def test_sparse_attention_reads_a_bounded_number_of_keys_whatever_the_length(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from rlsys import kernels

    layer = sparse_layer()  # B=2, k=8, tiles of 4 queries, 64 tiles per chunk
    cfg = layer.cfg
    widest: list[int] = []
    original = kernels.block_attention

    def spy(q, k, v, visible, scale):  # type: ignore[no-untyped-def]
        widest.append(k.shape[0] * k.shape[1] * k.shape[2])  # items x blocks x slots
        return original(q, k, v, visible, scale)

    monkeypatch.setattr(kernels, "block_attention", spy)
    run_layer(layer, torch.randn(2048, cfg.d_model))
    per_tile_blocks = cfg.sparse_query_tile * cfg.sparse_selected_blocks + cfg.sparse_query_tile
    bound = cfg.tiles_per_chunk * cfg.n_kv_groups * per_tile_blocks * cfg.sparse_block
    assert len(widest) == 2048 // (cfg.sparse_query_tile * cfg.tiles_per_chunk)
    assert max(widest) <= bound < 2048 * 2048 // 8
