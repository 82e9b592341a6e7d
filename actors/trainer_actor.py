"""The trainer as a Ray actor: steps on batches of trajectories, checkpoints, publishes weights.

It adds transport only: trajectories arrive through the rollout stream (the controller
names the rollout ids of a step; `TrajectoryInbox` reads, holds and acknowledges); weights
leave either as a CPU
state dict (`weights()`, put in the object store once, read by every replica) or by a
collective broadcast (`sync_*`, see `rlsys.actors.weight_publish`); checkpoints are
written atomically by the core `Trainer`. The warm start and the critic's pre-training
draw demonstrations from the task itself. An actor Ray gave a GPU trains there.

With `trainer.data_parallel` N > 1 this actor is rank 0 of N FSDP2 ranks
(`rlsys.actors.trainer_ranks`): it alone reads the stream and talks to the controller and
the engines; every call that touches the sharded policy runs on all ranks together, and
the weights it publishes (object store) are gathered full tensors, never shards.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import ray

from rlsys.config.job import JobConfig
from rlsys.control.messages import StepReport, StreamPosition, TrainerPosition, WarmStartReport

if TYPE_CHECKING:  # torch is imported inside the actor's process only
    from torch import Tensor, nn

    from rlsys.engine.sync_group import Rendezvous
    from rlsys.trajectory import Trajectory

StateDict = dict[str, "Tensor"]


@ray.remote(max_restarts=0)
class TrainerActor:
    def __init__(self, cfg: JobConfig, checkpoint: str | None, stream_url: str) -> None:
        import torch

        from rlsys.actors.trainer_ranks import RankGroup, build_trainer, join_group
        from rlsys.control.trajectory_inbox import TrajectoryInbox
        from rlsys.engine.sync_group import GroupMember
        from rlsys.ledger.stream import open_stream

        torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
        self.cfg = cfg
        restore = checkpoint if checkpoint and Path(checkpoint).exists() else None
        self.ranks: RankGroup | None = None
        data_parallel = None
        if self.cfg.trainer.data_parallel > 1:  # the followers first: joining waits for them
            self.ranks = RankGroup(self.cfg, restore)
            data_parallel = join_group(self.cfg, self.ranks.init_method, 0)
        self.trainer = build_trainer(self.cfg, data_parallel)
        self.model = self.trainer.model
        self.sync = GroupMember()
        self.resumed: StreamPosition | None = None
        if restore is not None:  # the followers restore the same file in their __init__
            self.resumed = StreamPosition.from_record(self.trainer.restore(restore))
        self.inbox = TrajectoryInbox(open_stream(stream_url))
        # Whatever this trainer's predecessor read and did not commit comes back to us; what
        # the checkpoint says it consumed is acked (the crash may have preceded the ack).
        consumed = self.resumed.consumed_entries if self.resumed is not None else []
        self.redelivered = self.inbox.resume(consumed)

    def position(self) -> TrainerPosition:
        """Where this trainer stands: step, version, and the stream position it last stored."""
        return TrainerPosition(
            self.trainer.step, self.trainer.version, self.resumed, self.redelivered
        )

    def _demonstrations(self) -> list[Trajectory]:
        """The task's demonstrations (deterministic from the seed), made once."""
        if getattr(self, "_demos", None) is None:
            from functools import partial

            from rlsys.rollout.demos import make_demonstrations
            from rlsys.rollout.job_sections import scaffold_config
            from rlsys.rollout.tasks.registry import build_task, parse_task_config
            from rlsys.sandboxes.registry import open_sandbox, parse_sandbox_config

            ws = self.cfg.trainer.warm_start
            self._task = build_task(parse_task_config(self.cfg.rollout.task))
            sandbox = partial(open_sandbox, parse_sandbox_config(self.cfg.rollout.sandbox))
            self._demos = make_demonstrations(
                self._task,
                self.cfg.seed + 7919,
                ws.demonstrations,
                sandbox,
                scaffold_config(self.cfg),
                slip_rate=ws.slip_rate,
            )
        return self._demos

    def warm_start(self) -> WarmStartReport:
        from rlsys.trainer.warm_start import supervised_warm_start

        ws = self.cfg.trainer.warm_start
        demos = self._demonstrations()
        model = self._unsharded_copy() if self.ranks is not None else self.model
        losses = supervised_warm_start(
            model,
            demos,
            steps=ws.steps,
            lr=ws.lr,
            batch_size=ws.batch_size,
            options=self.trainer.logprob_options,
            grad_clip=self.cfg.trainer.grad_clip,
            seed=self.cfg.seed,
            content_ids=self._task.content_token_ids,
            content_weight=ws.content_weight,
            lr_schedule=ws.lr_schedule,
            mtp_weight=self.cfg.trainer.mtp_weight,
        )
        if self.ranks is not None:  # every rank takes its shard of the warm-started weights
            self._load_full({k: v.detach().cpu() for k, v in model.state_dict().items()})
        return WarmStartReport(len(demos), losses[0], losses[-1])

    # ---- the data-parallel ranks (trainer.data_parallel > 1) ----------------------------------

    def _full_state(self) -> StateDict:
        """The policy's full weights on the CPU, gathered from every rank (a collective)."""
        from rlsys.trainer.fsdp import full_state_dict

        assert self.ranks is not None
        return self.ranks.collective("gather", (), lambda: full_state_dict(self.model))

    def _load_full(self, state: StateDict) -> None:
        from rlsys.trainer.fsdp import load_full_state_dict

        assert self.ranks is not None
        ref = ray.put(state)  # once in the object store, read by every follower
        self.ranks.collective("load_full", (ref,), lambda: load_full_state_dict(self.model, state))

    def _unsharded_copy(self) -> nn.Module:
        """A plain model holding the policy's full weights: the supervised warm start runs
        on it here, on rank 0 alone (it is not a data-parallel loop)."""
        from rlsys.model.policy import build_policy

        model = build_policy(self.cfg.model).to(self.trainer.device)
        model.load_state_dict(self._full_state())
        return model

    def pretrain_critic(self) -> dict[str, float] | None:
        """`algo.critic.pretrain_steps` value-regression steps on the demonstrations."""
        from rlsys.trainer.critic_pretrain import pretrain_critic_on_demonstrations

        demos = self._demonstrations()
        if self.ranks is None:
            return pretrain_critic_on_demonstrations(self.trainer, demos)
        return self.ranks.collective(  # every rank fits the same replicated critic
            "pretrain_critic",
            (ray.put(demos),),
            lambda: pretrain_critic_on_demonstrations(self.trainer, demos),
        )

    def step(self, rollout_ids: list[str], timeout_s: float) -> StepReport:
        """Train on the trajectories of `rollout_ids`, read from the stream."""
        trajectories = self.inbox.take(rollout_ids, timeout_s)
        if self.ranks is None:
            result = self.trainer.train_step(trajectories)
        else:  # every rank is given the same list (object store) and takes its share
            result = self.ranks.collective(
                "train_step",
                (ray.put(trajectories),),
                lambda: self.trainer.train_step(trajectories),
            )
        return StepReport(
            stepped=result.stepped,
            version=result.metrics.policy_version,
            metrics=result.metrics.as_dict(),
            filtered=list(result.filtered),
            entries=self.inbox.entry_ids(rollout_ids),
        )

    def set_position(self, step: int, version: int) -> None:
        """Adopt the ledger's newest committed step (a checkpoint older than it lost the
        updates of the steps since, which stay counted: see `Controller._agree_on_step`)."""
        self.trainer.step, self.trainer.version = step, version
        if self.ranks is not None:  # the learning-rate schedule and staleness read them
            self.ranks.each("set_position", step, version)

    def held(self) -> list[str]:
        """Rollout ids whose entries this trainer holds, unacknowledged."""
        return list(self.inbox.entries)

    def commit(self, rollout_ids: list[str], discard: list[str]) -> int:
        """The ledger holds the step's outcome: acknowledge its entries (and dead ones)."""
        return self.inbox.commit(rollout_ids) + self.inbox.discard(discard)

    def weights(self) -> StateDict:
        # Always CPU copies: the object store then needs no CUDA on the reader's side.
        if self.ranks is not None:  # full tensors, gathered (native model: its state dict)
            return self._full_state()
        state = self.model.engine_state_dict()  # the names and layout the engine loads
        return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}

    # ---- collective weight transport (engine.weight_transport: collective) --------------------

    def sync_listen(self, world_size: int, generation: int, timeout_s: float) -> Rendezvous:
        from ray.util import get_node_ip_address

        backend = "nccl" if next(self.model.parameters()).is_cuda else "gloo"
        return self.sync.listen(get_node_ip_address(), world_size, generation, backend, timeout_s)

    def sync_join(self, rendezvous: Rendezvous) -> int:
        self.sync.join(rendezvous, 0)
        return 0

    def sync_send(self, version: int) -> int:
        """Broadcast the current weights as `version`; returns the bytes sent."""
        from rlsys.engine.weight_sync import plan_buckets, send

        # (not with trainer.data_parallel > 1: the config refuses the collective transport)
        state = self.model.state_dict()
        return send(state, plan_buckets(state), version)

    def checkpoint(self, path: str, position: StreamPosition | None) -> str:
        """Write the checkpoint, recording `position` (None: no step yet, the step-0 one)."""
        record = position.as_record() if position is not None else {}
        if self.ranks is None:
            return str(self.trainer.save_checkpoint(path, record))
        return str(  # every rank gathers, rank 0 writes
            self.ranks.collective(
                "checkpoint", (path,), lambda: self.trainer.save_checkpoint(path, record)
            )
        )
