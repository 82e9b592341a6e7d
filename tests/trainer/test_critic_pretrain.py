"""The job's critic pre-training: `algo.critic.pretrain_steps` steps on demonstrations."""

from __future__ import annotations

import pytest
import torch

from rlsys.config.algo import AlgoConfig, CriticConfig
from rlsys.config.sampling import SamplingConfig
from rlsys.rollout.compaction import CompactionConfig
from rlsys.rollout.demos import make_demonstrations
from rlsys.rollout.scaffold import ScaffoldConfig
from rlsys.rollout.tasks.arithmetic import ArithmeticTask, ArithmeticTaskConfig
from rlsys.trainer.critic_pretrain import pretrain_critic_on_demonstrations, value_loss
from tests.trainer.helpers import make_trainer, tiny_model

pytestmark = pytest.mark.unit

SCAFFOLD = ScaffoldConfig(
    max_turns=3,
    context_budget=256,
    sampling=SamplingConfig(max_tokens_per_turn=40),
    max_observation_tokens=32,
    compaction=CompactionConfig(max_compactions=0),
)


def _demos(seed: int, n: int):  # type: ignore[no-untyped-def]
    task = ArithmeticTask(ArithmeticTaskConfig(max_factor=9, max_addend=9, instructions=False))

    def no_sandbox():  # type: ignore[no-untyped-def]
        raise RuntimeError("the arithmetic task needs no sandbox")

    return make_demonstrations(task, seed, n, no_sandbox, SCAFFOLD, slip_rate=0.5)


@pytest.mark.parametrize("steps", [0, 30])
def test_pretrained_critic_fits_held_out_returns(steps: int) -> None:
    torch.manual_seed(0)
    critic = CriticConfig(enabled=True, lr=1e-2, warmup_updates=30, pretrain_steps=steps)
    trainer = make_trainer(tiny_model(vocab_size=320), algo=AlgoConfig(critic=critic))
    train, held_out = _demos(0, 16), _demos(1, 12)
    assert {t.reward for t in held_out} == {0.0, 1.0}
    before = value_loss(trainer, held_out)
    policy = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    report = pretrain_critic_on_demonstrations(trainer, train)
    after = value_loss(trainer, held_out)
    if steps == 0:  # off: nothing runs, the critic is as it was and not ready
        assert report is None and after == before and not trainer.critic.ready  # type: ignore[union-attr]
        return
    assert report is not None and report["loss_last"] < report["loss_first"]
    assert after < 0.8 * before
    assert trainer.critic.ready  # type: ignore[union-attr]  # its baseline is used from step 1
    for key, value in trainer.model.state_dict().items():  # the policy never moves
        assert torch.equal(value, policy[key]), key
