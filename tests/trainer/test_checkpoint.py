"""Checkpoint and resume: atomic files, and a resumed trainer neither skips nor repeats.

The stream is the real in-memory rollout stream (ack after commit). A "crash" drops the
trainer and its consumer at a chosen point; a fresh trainer restores the checkpoint and
resumes the consumer from the stream position the checkpoint recorded.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch

from rlsys.config.algo import AlgoConfig
from rlsys.ledger.stream import open_stream, resume_consumer
from rlsys.trainer import Trainer, load_checkpoint, save_checkpoint
from rlsys.trajectory import Trajectory
from tests.trainer.helpers import engine_trajectories, make_trainer, tiny_model

pytestmark = pytest.mark.unit

PER_STEP = 4
ALGO = AlgoConfig(max_staleness=100)  # the pool is sampled once, at version 0


def _pool() -> dict[str, Trajectory]:
    trajs = engine_trajectories(tiny_model(), groups=6, group_size=2)
    return {t.rollout_id: t for t in trajs}


def _step(trainer: Trainer, pool, entries, trained: list[str]) -> None:  # type: ignore[no-untyped-def]
    result = trainer.train_step(
        [pool[e.rollout_id] for e in entries],
        {"consumed_entries": [e.entry_id for e in entries]},
    )
    trained += result.trained


def _publish(pool: dict[str, Trajectory]):  # type: ignore[no-untyped-def]
    stream = open_stream(f"memory://trainer-test-{uuid.uuid4().hex}")
    stream.publish_many([(rid, rid) for rid in pool])
    return stream


@pytest.mark.parametrize("crash", ["after_checkpoint_before_ack", "after_step_before_checkpoint"])
def test_resumed_trainer_neither_skips_nor_repeats(tmp_path: Path, crash: str) -> None:
    pool = _pool()
    steps = len(pool) // PER_STEP

    # the uninterrupted run
    stream = _publish(pool)
    ref = make_trainer(tiny_model(), algo=ALGO)
    ref_trained: list[str] = []
    for _ in range(steps):
        entries = stream.read("c0", count=PER_STEP)
        _step(ref, pool, entries, ref_trained)
        stream.ack([e.entry_id for e in entries])

    # the interrupted run: step 1 committed; step 2 dies at `crash`
    stream = _publish(pool)
    path = tmp_path / "ckpt.pt"
    first = make_trainer(tiny_model(), algo=ALGO)
    committed: list[str] = []
    for step in range(2):
        entries = stream.read("c1", count=PER_STEP)
        pending: list[str] = []
        _step(first, pool, entries, pending)
        if step == 1 and crash == "after_step_before_checkpoint":
            break  # the step's work is lost with the process
        first.save_checkpoint(path)
        committed += pending
        if step == 1:
            break  # crash: checkpoint written, entries never acked
        stream.ack([e.entry_id for e in entries])

    resumed = make_trainer(tiny_model(seed=99), algo=ALGO)  # other init: restore must win
    position = resumed.restore(path)
    assert resumed.step == len(committed) // PER_STEP == resumed.version
    redo = resume_consumer(stream, "c2", position["consumed_entries"])
    while resumed.step < steps:
        entries = redo[:PER_STEP] or stream.read("c2", count=PER_STEP)
        redo = redo[PER_STEP:]
        _step(resumed, pool, entries, committed)
        stream.ack([e.entry_id for e in entries])

    assert sorted(committed) == sorted(pool) and len(committed) == len(set(committed))
    assert committed == ref_trained
    for a, b in zip(
        ref.model.state_dict().values(), resumed.model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b)


def test_checkpoint_write_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, {"step": 1})

    def torn(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", torn)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(path, {"step": 2})
    monkeypatch.undo()
    assert load_checkpoint(path)["step"] == 1  # the old checkpoint is intact
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]  # no temporary left behind


def test_checkpoint_keeps_optimiser_critic_and_reference(tmp_path: Path) -> None:
    algo = AlgoConfig(kl_coef=0.1, critic={"enabled": True, "warmup_updates": 0})
    model = tiny_model()
    trainer = make_trainer(model, algo=algo)
    trainer.train_step(engine_trajectories(model))
    trainer.save_checkpoint(tmp_path / "c.pt", {"cursor": "0-4"})
    other = make_trainer(tiny_model(seed=5), algo=algo)
    assert other.restore(tmp_path / "c.pt") == {"cursor": "0-4"}
    assert other.reference is not None and other.critic is not None
    assert int(other.critic.updates) == 1
    assert (
        other.optimizer.state_dict()["state"].keys()
        == trainer.optimizer.state_dict()["state"].keys()
    )
    trajs = engine_trajectories(model, version=1, seed=3)
    a, b = trainer.train_step(trajs).metrics, other.train_step(trajs).metrics
    assert (a.loss, a.kl, a.critic_loss) == (b.loss, b.kl, b.critic_loss)
