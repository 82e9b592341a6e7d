"""Log-prob alignment with the engine, and what each replay changes (docs/ARCHITECTURE.md,
"Numerics")."""

from __future__ import annotations

import copy

import pytest
import torch

from rlsys.model import Transformer, token_log_probs
from rlsys.model.moe import MoE
from rlsys.trainer.batch import pack
from tests.trainer.helpers import behaviour, engine_trajectories, make_trainer, tiny_model

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_staleness_zero_recomputed_log_probs_equal_behaviour_bitwise(dtype: str) -> None:
    model = tiny_model(compute_dtype=dtype)
    trajs = engine_trajectories(model, top_p=0.9)
    trainer = make_trainer(model, replay_experts="off")
    for traj, logp in zip(trajs, trainer.log_probs(trajs), strict=True):
        assert torch.equal(logp, behaviour(traj))
    result = trainer.train_step(trajs)  # the training forward (train mode, autograd) too
    m = result.metrics
    assert m.mean_importance_weight == 1.0 and m.clipped_fraction == 0.0
    assert m.logprob_drift_max_abs == 0.0 and m.staleness_max == 0
    assert m.mismatch is not None and m.mismatch["tokens"] == m.num_policy_tokens
    sizes = m.candidate_set  # top_p 0.9: nuclei, narrower than the vocabulary
    assert sizes is not None and 1 <= sizes["p50"] <= sizes["max"] < model.cfg.vocab_size
    assert m.mismatch["max_abs"] == 0.0 and m.mismatch["k3_kl"] == 0.0


def test_mismatch_reads_the_staleness_zero_tokens_only() -> None:
    model = tiny_model()
    trajs = engine_trajectories(model, groups=2)
    trainer = make_trainer(model, replay_experts="off", mismatch_rollouts=0)
    for seg in trajs[0].segments:  # one rollout's recorded log-probs off by a known amount
        seg.logprobs = [lp - 0.25 for lp in seg.logprobs] if seg.logprobs else seg.logprobs
    m = trainer.train_step(trajs).metrics
    assert m.mismatch is not None and m.mismatch["max_abs"] == pytest.approx(0.25, abs=1e-5)
    assert m.mismatch["k3_kl"] > 0.0
    # no reference policy (kl_coef 0): `kl` is the behaviour -> current k3, not a 0 unread
    assert m.kl_source == "behaviour" and m.kl > 0.0
    # the next step's samples say version 0 while the trainer holds 1: no fresh token, and
    # with no host copies kept (mismatch_rollouts 0) nothing else is measured
    assert trainer.train_step(engine_trajectories(model, groups=2)).metrics.mismatch is None


def test_micro_batches_and_lm_head_chunks_do_not_change_log_probs() -> None:
    model = tiny_model()
    trajs = engine_trajectories(model, groups=3)
    whole = make_trainer(model, micro_batch_tokens=10_000, lm_head_chunk=0).log_probs(trajs)
    split = make_trainer(model, micro_batch_tokens=40, lm_head_chunk=7).log_probs(trajs)
    for a, b in zip(whole, split, strict=True):
        assert torch.equal(a, b)


def _perturb_routers(model: Transformer, scale: float = 2.0) -> None:
    torch.manual_seed(123)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, MoE):
                m.router.add_(torch.randn_like(m.router) * scale * m.router.std())


def _spy_routes(model: Transformer, monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """Record the expert ids every MoE layer actually uses (in layer order)."""
    seen: list[torch.Tensor] = []
    original = MoE._route

    def spy(self, scores, routing):  # type: ignore[no-untyped-def]
        idx, gates = original(self, scores, routing)
        seen.append(idx.detach().clone())
        return idx, gates

    monkeypatch.setattr(MoE, "_route", spy)
    return seen


def test_indices_replay_restores_recorded_expert_choice_under_perturbed_router(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = tiny_model()
    trajs = engine_trajectories(model, groups=2)
    batch = pack([(i, t.segments[0], t) for i, t in enumerate(trajs)])
    assert batch.routes is not None
    rows = batch.routed_rows_N
    recorded = batch.routes.indices[:, rows]  # (L, R, k)
    _perturb_routers(model)
    seen = _spy_routes(model, monkeypatch)
    without = make_trainer(model, replay_experts="off").log_probs(trajs)
    chosen_off = torch.stack(seen)[:, rows]
    assert not torch.equal(chosen_off, recorded)  # the perturbation changes the routing
    seen.clear()
    with_replay = make_trainer(model, replay_experts="indices").log_probs(trajs)
    assert torch.equal(torch.stack(seen)[:, rows], recorded)
    # the replayed forward is nearer the engine's log-probs than the unreplayed one
    drift = [(lp - behaviour(t)).abs().mean() for lp, t in zip(with_replay, trajs, strict=True)]
    drift_off = [(lp - behaviour(t)).abs().mean() for lp, t in zip(without, trajs, strict=True)]
    assert sum(drift) < sum(drift_off)


def test_gates_replay_matches_engine_bitwise_and_differs_from_indices_only_after_update() -> None:
    model = tiny_model()
    trajs = engine_trajectories(model)
    trainer = make_trainer(model, replay_experts="indices_and_gates")
    for traj, logp in zip(trajs, trainer.log_probs(trajs), strict=True):
        assert torch.equal(logp, behaviour(traj))
    _perturb_routers(model, scale=0.5)
    gates = trainer.log_probs(trajs)
    indices = trainer.log_probs(trajs, replay="indices")
    assert any(not torch.equal(a, b) for a, b in zip(gates, indices, strict=True))


def test_candidate_replay_changes_log_probs_exactly_as_masking_predicts() -> None:
    model = tiny_model()
    trajs = engine_trajectories(model, top_p=0.8)
    on = make_trainer(model, replay_candidates=True).log_probs(trajs)
    off = make_trainer(model, replay_candidates=False).log_probs(trajs)
    for traj, lp_on, lp_off in zip(trajs, on, off, strict=True):
        assert torch.equal(lp_on, behaviour(traj))
        seg = traj.segments[0]
        ids = torch.tensor(seg.token_ids)
        with torch.no_grad():
            logits = model(ids[None], with_mtp=False).logits[0]
        policy = [i for i, m in enumerate(seg.policy_mask) if m]
        full = torch.log_softmax(logits[[i - 1 for i in policy]], -1)
        # masking to the candidate set C renormalises: log p_C(y) = log p(y) - log sum_C p
        mass = torch.stack(
            [
                torch.logsumexp(full[j, seg.candidate_ids[i]], 0)
                if seg.candidate_ids[i]
                else torch.zeros(())
                for j, i in enumerate(policy)
            ]
        )
        assert torch.allclose(lp_on, lp_off - mass, atol=1e-5)
        assert torch.allclose(lp_off, token_log_probs(logits[[i - 1 for i in policy]], ids[policy]))
        assert (mass < 0).any()  # some sets were a strict part of the vocabulary


@pytest.mark.parametrize("sampled", [2, 0])
def test_mismatch_of_stale_rollouts_is_read_under_the_weights_that_sampled_them(
    sampled: int,
) -> None:
    import copy

    model = tiny_model()
    v0 = copy.deepcopy(model)  # the weights the engine keeps serving as version 0
    trainer = make_trainer(model, lr=1e-2, mismatch_rollouts=sampled)
    trainer.train_step(engine_trajectories(model, groups=2))  # the policy moves to v1
    stale = engine_trajectories(v0, groups=2, version=0, seed=5)
    m = trainer.train_step(stale).metrics
    assert m.staleness_max == 1 and m.logprob_drift_max_abs > 0.0  # the update shows as drift
    if sampled:  # ...and not as mismatch: under version 0's own weights it is bitwise 0
        assert m.mismatch is not None and m.mismatch["tokens"] > 0
        assert m.mismatch["max_abs"] == 0.0
    else:
        assert m.mismatch is None  # nothing at staleness 0, no copies kept: not measured


@pytest.mark.parametrize("context_routes", [True, False])
def test_r3_over_every_row_reproduces_the_engine_under_a_moved_router(
    context_routes: bool,
) -> None:
    """Routes and gates replayed on every row the policy conditioned on (prompt and
    observations too, as the scaffold records them) make the forward the engine's, however
    the router has moved; replayed on the sampled tokens' rows alone, the context is
    re-routed and the log-probs move."""
    model = tiny_model()
    trajs = engine_trajectories(model, context_routes=context_routes)
    _perturb_routers(model, scale=0.5)
    trainer = make_trainer(model, replay_experts="indices_and_gates")
    recomputed = trainer.log_probs(trajs)
    same = [torch.equal(lp, behaviour(t)) for lp, t in zip(recomputed, trajs, strict=True)]
    assert all(same) if context_routes else not all(same)
    # the reference policy's forward replays the same rows
    trainer.reference = copy.deepcopy(model)
    batch = pack([(i, t.segments[0], t) for i, t in enumerate(trajs)])
    ref = trainer._reference_log_probs(batch)
    assert torch.equal(ref, torch.cat([behaviour(t) for t in trajs])) == context_routes
