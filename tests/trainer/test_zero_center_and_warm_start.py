"""The zero-center projection in the trainer's LM head (its bf16 guarantee:
`test_zero_center_bf16.py`), and the supervised warm start."""

from __future__ import annotations

import math

import pytest
import torch

from rlsys.trainer import LogProbOptions, supervised_warm_start
from rlsys.trainer import logprobs as logprobs_module
from tests.trainer.helpers import engine_trajectories, make_trainer, tiny_model

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("on", [True, False])
def test_trainer_projects_over_the_allowed_set_only_when_configured(
    monkeypatch: pytest.MonkeyPatch, on: bool
) -> None:
    masks: list[torch.Tensor] = []
    original = logprobs_module.zero_center

    def spy(logits: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        masks.append(mask)
        return original(logits, mask)

    monkeypatch.setattr(logprobs_module, "zero_center", spy)
    model = tiny_model()
    trajs = engine_trajectories(model, groups=1, top_p=0.7)
    make_trainer(model, zero_center=on).train_step(trajs)
    assert bool(masks) == on
    if on:  # over each token's candidate set, never over the whole vocabulary
        assert all(m is not None and (m.sum(-1) < model.cfg.vocab_size).any() for m in masks)


def test_warm_start_lowers_the_demonstrations_negative_log_likelihood() -> None:
    model = tiny_model()
    demos = engine_trajectories(tiny_model(seed=7), groups=2, group_size=2)
    opts = LogProbOptions(valid_vocab=model.cfg.vocab_size)
    losses = supervised_warm_start(model, demos, steps=15, lr=1e-2, batch_size=2, options=opts)
    assert losses[-1] < 0.7 * losses[0]
    trainer = make_trainer(model)
    assert trainer.version == 0  # the warm start is version 0 for the engine


def test_content_weight_adds_the_content_tokens_mean_nll_to_the_loss() -> None:
    """Same data, same seed: the extra term changes the update (only when content exists)
    and the reported NLL stays the plain mean over policy tokens."""
    demos = engine_trajectories(tiny_model(seed=7), groups=2, group_size=2)
    opts = LogProbOptions(valid_vocab=tiny_model().cfg.vocab_size)
    targets = {
        t
        for d in demos
        for s in d.segments
        for t, m in zip(s.token_ids, s.policy_mask, strict=True)
        if m
    }
    content = frozenset(sorted(targets)[: max(1, len(targets) // 4)])

    def one_step(ids: frozenset[int], weight: float) -> tuple[list[float], dict]:
        model = tiny_model()
        kw = {"content_ids": ids, "content_weight": weight}
        losses = supervised_warm_start(
            model, demos, steps=1, lr=1e-2, batch_size=4, options=opts, **kw
        )
        return losses, {k: v.clone() for k, v in model.state_dict().items()}

    plain_loss, plain = one_step(frozenset(), 0.0)
    weighted_loss, weighted = one_step(content, 2.0)
    absent_loss, absent = one_step(frozenset({10**6}), 2.0)  # no such token: no extra term
    assert plain_loss == weighted_loss == absent_loss  # the first step reports the plain NLL
    assert any(not torch.equal(plain[k], weighted[k]) for k in plain)
    assert all(torch.equal(plain[k], absent[k]) for k in plain)


def test_cosine_warm_start_decays_the_rate_to_zero_and_constant_does_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The rate each AdamW step used, as the optimiser saw it."""
    demos = engine_trajectories(tiny_model(seed=7), groups=1, group_size=2)
    opts = LogProbOptions(valid_vocab=tiny_model().cfg.vocab_size)
    seen: list[float] = []
    original = torch.optim.AdamW.step

    def spy(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(self.param_groups[0]["lr"])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", spy)
    for schedule in ("cosine", "constant"):
        supervised_warm_start(
            tiny_model(), demos, steps=4, lr=1e-2, batch_size=2, options=opts,
            lr_schedule=schedule,
        )  # fmt: skip
    cosine, constant = seen[:4], seen[4:]
    assert cosine[0] == 1e-2 and cosine == sorted(cosine, reverse=True)
    assert cosine[-1] == pytest.approx(1e-2 * 0.5 * (1 + math.cos(math.pi * 3 / 4)))
    assert constant == [1e-2] * 4
