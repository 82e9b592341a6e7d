"""Sparse GQA selection replay: the trainer attends to the blocks the engine selected.

The indexer is perturbed (as staleness moves it); only selections change, so with the
experts replayed too the recomputed log-probs are the engine's bitwise exactly when the
selections are replayed, and differ when they are not.
"""

from __future__ import annotations

import copy

import pytest
import torch

from rlsys.model import Transformer
from rlsys.model.sparse_gqa import SparseGQA
from rlsys.trainer.batch import pack
from tests.trainer.helpers import behaviour, engine_trajectories, make_trainer, tiny_model

pytestmark = pytest.mark.unit


def _perturb_indexers(model: Transformer, scale: float = 1.0) -> None:
    torch.manual_seed(7)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, SparseGQA):
                for w in (m.w_index_q, m.w_index_k):
                    w.add_(torch.randn_like(w) * scale * w.std())


@pytest.mark.parametrize("replay_selections", [True, False])
def test_selection_replay_reproduces_the_engine_under_a_moved_indexer(
    replay_selections: bool,
) -> None:
    model = tiny_model()
    trajs = engine_trajectories(model, record_selections=True, prompt_len=16)
    _perturb_indexers(model)
    trainer = make_trainer(
        model, replay_experts="indices_and_gates", replay_selections=replay_selections
    )
    recomputed = trainer.log_probs(trajs)
    same = [torch.equal(lp, behaviour(t)) for lp, t in zip(recomputed, trajs, strict=True)]
    assert all(same) if replay_selections else not any(same)
    # the reference policy's forward replays them too
    trainer.reference = copy.deepcopy(model)
    batch = pack([(i, t.segments[0], t) for i, t in enumerate(trajs)])
    ref = trainer._reference_log_probs(batch)
    assert torch.equal(ref, torch.cat([behaviour(t) for t in trajs])) == replay_selections


def test_selection_replay_without_recorded_selections_is_an_error() -> None:
    model = tiny_model()
    trajs = engine_trajectories(model, groups=1)
    trainer = make_trainer(model, replay_selections=True)
    with pytest.raises(ValueError, match="record_selections"):
        trainer.log_probs(trajs)


def test_recorded_selections_are_compact_and_only_as_wide_as_needed() -> None:
    model = tiny_model()
    traj = engine_trajectories(model, groups=1, group_size=1, record_selections=True)[0]
    seg = traj.segments[0]
    token = next(e for e in seg.routed_experts if e is not None)
    assert token["blocks"].dtype == torch.int16
    cfg = model.cfg
    n_sparse = cfg.layer_kinds().count("sparse")
    assert token["blocks"].shape == (n_sparse, cfg.n_kv_groups, cfg.sparse_selected_blocks)
    start, block = seg.context_routes[0]
    # prompt rows before the (k/B + 1)-th complete block select everything they see: the
    # record is as wide as the widest row, never wider than k / B
    assert block["blocks"].shape[-1] <= cfg.sparse_selected_blocks


def test_a_training_step_with_selection_replay_steps_and_trains_the_indexer() -> None:
    model = tiny_model()
    trajs = engine_trajectories(model, record_selections=True, prompt_len=16)
    trainer = make_trainer(model, replay_selections=True, lr=1e-2)
    before = [m.w_index_q.detach().clone() for m in model.modules() if isinstance(m, SparseGQA)]
    result = trainer.train_step(trajs)
    assert result.stepped
    after = [m.w_index_q for m in model.modules() if isinstance(m, SparseGQA)]
    assert all(not torch.equal(a, b) for a, b in zip(after, before, strict=True))
