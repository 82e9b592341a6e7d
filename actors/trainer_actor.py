"""The trainer as a Ray actor: steps on batches of trajectories, checkpoints, publishes weights.

It adds transport only: batches arrive from the controller, `weights()` returns a state dict
(put in the object store once, read by every replica), checkpoints are written atomically
by the core `Trainer`. The warm start draws demonstrations from the task itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ray


@ray.remote(max_restarts=0)
class TrainerActor:
    def __init__(self, job_config: dict[str, Any], checkpoint: str | None) -> None:
        import torch

        from rlsys.config.job import JobConfig
        from rlsys.model import Transformer
        from rlsys.tokenizer import VOCAB_SIZE
        from rlsys.trainer.trainer import Trainer

        torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
        self.cfg = JobConfig.model_validate(job_config)
        torch.manual_seed(self.cfg.seed)
        self.model = Transformer(self.cfg.model.resolve())
        self.trainer = Trainer(
            self.model,
            self.cfg.trainer,
            self.cfg.algo,
            temperature=self.cfg.sampling.temperature,
            valid_vocab=VOCAB_SIZE,  # the engine samples only tokenizer ids (sample_vocab)
        )
        self.resumed_position: dict[str, Any] = {}
        if checkpoint and Path(checkpoint).exists():
            self.resumed_position = self.trainer.restore(checkpoint)

    def position(self) -> dict[str, Any]:
        """Where this trainer stands: step, version, and the stream position it last stored."""
        return {
            "step": self.trainer.step,
            "version": self.trainer.version,
            "stream_position": self.resumed_position,
        }

    def warm_start(self) -> dict[str, Any]:
        from functools import partial

        from rlsys.actors.job_sections import scaffold_config
        from rlsys.sandboxes.demos import make_demonstrations
        from rlsys.sandboxes.registry import open_sandbox, parse_sandbox_config
        from rlsys.sandboxes.tasks.registry import build_task, parse_task_config
        from rlsys.trainer.warm_start import supervised_warm_start

        ws = self.cfg.trainer.warm_start
        task = build_task(parse_task_config(self.cfg.rollout.task))
        sandbox = partial(open_sandbox, parse_sandbox_config(self.cfg.rollout.sandbox))
        demos = make_demonstrations(
            task,
            self.cfg.seed + 7919,
            ws.demonstrations,
            sandbox,
            scaffold_config(self.cfg),
        )
        losses = supervised_warm_start(
            self.model,
            demos,
            steps=ws.steps,
            lr=ws.lr,
            batch_size=ws.batch_size,
            options=self.trainer.logprob_options,
            grad_clip=self.cfg.trainer.grad_clip,
            seed=self.cfg.seed,
            content_ids=task.content_token_ids,
            content_weight=ws.content_weight,
        )
        return {"demonstrations": len(demos), "nll_first": losses[0], "nll_last": losses[-1]}

    def step(self, trajectories: list[Any], version: int) -> dict[str, Any]:
        return self.trainer.train_step(trajectories).as_dict()

    def weights(self) -> dict[str, Any]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def checkpoint(self, path: str, stream_position: dict[str, Any]) -> str:
        return str(self.trainer.save_checkpoint(path, stream_position))
