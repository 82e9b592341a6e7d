"""Sparse GQA selection record/replay at the model level (rlsys.model.sparse_gqa)."""

from __future__ import annotations

import pytest
import torch

from rlsys.config.model import preset
from rlsys.model import RoutedExperts, RoutingRecorder, RoutingReplay, Transformer
from rlsys.model.sparse_gqa import SparseGQA, blocks_mask, selected_ids

pytestmark = pytest.mark.unit


def test_engine_step_selections_concatenate_to_the_full_forward_record() -> None:
    """Prefill chunks and decode rows record the same selections as one full forward, and
    the compact form round-trips (records of different widths pad with -1)."""
    model = Transformer(preset("tiny")).eval()
    tokens = torch.randint(0, 64, (1, 24))
    full, parts = RoutingRecorder(blocks=True), []
    with torch.no_grad():
        model(tokens, routing=full)
        cache = model.new_cache()
        for lo, hi in [(0, 5), (5, 6), (6, 17), (17, 24)]:
            step = RoutingRecorder(blocks=True)
            model.forward_step([tokens[0, lo:hi]], [cache], routing=step)
            parts.append(RoutedExperts.from_compact(step.routes().to_compact(4)))
    widths = {p.blocks.shape[-1] for p in parts if p.blocks is not None}
    assert len(widths) > 1  # the early chunks select fewer than k / B blocks
    assert parts[0].blocks is not None and parts[0].blocks.dtype == torch.int64
    assert torch.equal(RoutedExperts.cat(parts).blocks, full.routes().blocks)


def test_replayed_selections_reproduce_the_recorded_forward_under_a_moved_indexer() -> None:
    model = Transformer(preset("tiny")).eval()
    tokens = torch.randint(0, 64, (2, 24))
    recorder = RoutingRecorder(blocks=True)
    with torch.no_grad():
        recorded = model(tokens, routing=recorder).logits
        routes = recorder.routes()
        for m in model.modules():
            if isinstance(m, SparseGQA):
                m.w_index_q.add_(torch.randn_like(m.w_index_q))
        moved = RoutingRecorder(blocks=True)
        free = model(tokens, routing=moved).logits
        replayed = model(tokens, routing=RoutingReplay(routes, use_gates=True, blocks=True))
    assert not torch.equal(moved.routes().blocks, routes.blocks)
    assert not torch.equal(free, recorded)
    assert torch.equal(replayed.logits, recorded)


def test_selected_ids_and_blocks_mask_are_inverse() -> None:
    mask = torch.rand(5, 2, 9) < 0.4
    ids = selected_ids(mask)
    assert ids.shape[-1] == int(mask.sum(-1).max())
    assert torch.equal(blocks_mask(ids, 9), mask)
