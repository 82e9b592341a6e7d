"""The trainer: a batch of trajectories in, one optimiser step out (no Ray; the actor wraps it).

One step (`train_step`), in order:
1. filters: samples beyond the staleness bound, then zero-variance groups; each dropped
   sample is returned with its ledger state and reason, none leaves silently;
2. advantages: group-relative outcome advantage plus the turn penalty on that turn's
   tokens, or, once the critic is past its pre-training phase, return minus critic value;
3. per micro-batch: packed forward with routed-expert replay, chunked LM head with top-p
   candidate-set replay and zero-center projection, the objective (`rlsys.algo`) weighted
   by the aggregation's per-token weights, backward (gradients accumulate); the MTP heads'
   loss on the same hidden states, detached (`mtp_loss.py`: it trains the heads only);
4. global gradient-norm clip (the policy's; the MTP heads' apart), AdamW, MoE balance
   update; step and policy version + 1.

Device: the trainer runs where the model's parameters are (CPU, or the GPU Ray gave its
actor). Packing builds on CPU and moves each micro-batch once; log-probs it returns to
callers are on CPU.

Where the policy lives is a strategy (`strategy.py`): `Local`, or `Sharded` (FSDP2 over a
data-parallel group: `data_parallel.py`, `fsdp.py`): every rank calls `train_step` with the
same trajectories and runs its share of the same micro-batches; the weights, `aux_scale`
and advantages are the whole batch's, the gradients are summed over ranks, the metrics are
global on every rank. The stale-rollout mismatch lives in `mismatch.py`, the critic's
pre-training in `critic_pretrain.py`.

Invariants: the loss of a batch does not depend on how it is split into micro-batches
or over ranks (per-token weights are computed over the whole batch); at staleness 0 with
the engine's weights the recomputed log-probs equal the behaviour log-probs bitwise (replay
off or `indices_and_gates`), so importance weights are exactly 1; a resumed trainer is the same
trainer (model, optimisers, step, version, stream position, reference policy).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rlsys.algo.advantages import critic_advantages, group_relative
from rlsys.algo.aggregate import TOKEN_WEIGHTS
from rlsys.algo.filters import Filtered, split_stale, split_zero_variance
from rlsys.algo.objectives import per_token_terms
from rlsys.config.algo import AlgoConfig
from rlsys.config.job import TrainerSection
from rlsys.kernels.host_to_device import moved_without_sync
from rlsys.model import AuxLosses
from rlsys.model.policy import PolicyModel
from rlsys.trainer.batch import PackedBatch, micro_batches, pack
from rlsys.trainer.checkpoint import load_checkpoint
from rlsys.trainer.critic import Critic
from rlsys.trainer.critic_pretrain import fit_critic
from rlsys.trainer.data_parallel import DataParallel, preserved_statistics
from rlsys.trainer.forward import packed_hidden
from rlsys.trainer.grad_clip import divided_gradients
from rlsys.trainer.logprobs import LogProbOptions, PolicyLogProbs, policy_log_probs
from rlsys.trainer.metrics import StepMetrics, TokenSums, candidate_set_sizes
from rlsys.trainer.mismatch import StaleMismatch
from rlsys.trainer.mtp_loss import mtp_loss, mtp_nll
from rlsys.trainer.step_batches import Group, StepBatches, check, group_rows, policy_samples
from rlsys.trainer.strategy import strategy_for
from rlsys.trajectory import Trajectory


@dataclass
class StepResult:
    """`stepped` is False when every sample was filtered (no optimiser step, same version)."""

    stepped: bool
    metrics: StepMetrics
    filtered: list[Filtered] = field(default_factory=list)
    trained: list[str] = field(default_factory=list)  # rollout ids that reached the step

    def as_dict(self) -> dict[str, Any]:
        return {
            "stepped": self.stepped,
            "version": self.metrics.policy_version,
            "metrics": self.metrics.as_dict(),
            "filtered": [asdict(f) for f in self.filtered],
            "trained": list(self.trained),
        }


@dataclass
class StepPlan:
    """What step 3 runs: the step's micro-batches (packed as the passes reach them), this
    rank's share of them and their per-token weights, the outcome advantages and the whole
    step's normalisers."""

    batches: StepBatches  # every micro-batch of the step, every rank's
    mine: list[int]  # this rank's, in pass order
    rows: list[int]  # packed rows of each micro-batch
    weights: list[Tensor]  # per-token weights of this rank's micro-batches, on the device
    outcome: Tensor
    use_critic: bool
    aux_scale: float
    padding: int  # weight-0 passes this rank adds (data parallel: as many passes per rank)


class Trainer:
    """Owns the policy's optimiser state, the optional critic and reference, and the counters.

    `temperature` must be the engine's sampling temperature, and `valid_vocab` (default: the
    model's vocabulary) the ids it may sample, so that recomputed log-probs are over the same
    distribution. Tokens with a recorded candidate set use that set instead (replay).

    `data_parallel`: shard the policy with FSDP2 over that mesh (`strategy.Sharded`: every
    method that touches the policy is then a collective: all ranks call it with the same
    arguments); without it the policy is local (`strategy.Local`).
    """

    def __init__(
        self,
        model: PolicyModel,
        cfg: TrainerSection,
        algo: AlgoConfig,
        *,
        temperature: float = 1.0,
        valid_vocab: int | None = None,
        data_parallel: DataParallel | None = None,
    ) -> None:
        self.model, self.cfg, self.algo = model, cfg, algo
        self.parallel = strategy_for(data_parallel)
        self.parallel.prepare(model)
        model.set_activation_checkpointing(cfg.activation_checkpointing)
        model.set_trunk_graphs(cfg.cuda_graphs)  # the config: one local rank, no checkpointing
        self.device = next(model.parameters()).device
        # fused: one kernel per step for every parameter (the per-parameter or foreach
        # updates are hundreds of launches); the optimiser's numerics are the trainer's own,
        # the engine only ever sees the weights it produces
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True
        )
        self.critic = (
            Critic(model.cfg.d_model, algo.critic).to(self.device) if algo.critic.enabled else None
        )
        self.reference: PolicyModel | None = None  # snapshot taken at the first RL step
        # host copies of recent versions, to recompute stale rollouts under their weights
        self.mismatch = StaleMismatch(cfg.mismatch_rollouts, algo.max_staleness, self.parallel)
        self.step = 0
        self.version = 0
        self.stream_position: dict[str, Any] = {}
        self.logprob_options = LogProbOptions(
            valid_vocab=min(valid_vocab or model.cfg.vocab_size, model.cfg.vocab_size),
            temperature=temperature,
            replay_candidates=cfg.replay_candidates,
            zero_center=cfg.zero_center,
            chunk=cfg.lm_head_chunk,
        )

    @property
    def dp(self) -> DataParallel | None:
        """The data-parallel group the policy is sharded over (None: local)."""
        return self.parallel.data_parallel

    # ---- the RL step -----------------------------------------------------------------------

    def train_step(
        self, trajectories: Sequence[Trajectory], stream_position: dict[str, Any] | None = None
    ) -> StepResult:
        """Filter, compute advantages, recompute log-probs under replay, take one step.

        `stream_position` (opaque) is what the caller has consumed once this step is taken;
        it is stored with the next checkpoint.
        """
        started = time.perf_counter()
        if any(t.reward != t.reward for t in trajectories):
            raise ValueError(
                "a trajectory with a NaN reward (a failed rollout) reached the trainer"
            )
        self.mismatch.snapshot(self.version, self.model)  # the weights that version sampled
        kept, filtered = self._filter(trajectories)  # 1. filters
        metrics = _step_metrics(self.step, self.version, trajectories, kept, filtered)
        if not kept:
            return StepResult(False, metrics, filtered)
        plan = self._plan(kept)  # 2. advantages, packing, per-token weights
        clamp_before = self.model.grad_clamp_clipped()  # on the device, not read
        sums = self._passes(plan)  # 3. forward and backward per micro-batch
        grad_norm = self._update()  # 4. clip, AdamW, MoE balance, critic
        self.step += 1
        self.version += 1
        self.mismatch.snapshot(self.version, self.model)
        self.mismatch.measure(kept, self.version - 1, self.model, self._recompute, sums)
        if stream_position is not None:
            self.stream_position = dict(stream_position)
        clipped = self.model.grad_clamp_clipped() - clamp_before
        # the step's one read of device values: the token sums, the grad norm, the clamps
        norm, clipped_count = sums.fill(metrics, extra=(grad_norm, clipped))
        metrics.candidate_set = candidate_set_sizes(plan.batches.host())  # host: no read
        metrics.step, metrics.policy_version = self.step, self.version
        metrics.num_tokens = sum(plan.rows)
        metrics.grad_norm = norm
        metrics.grad_clamp_clipped = self.parallel.reduce_count(int(clipped_count))
        metrics.critic_baseline = plan.use_critic
        metrics.step_s = time.perf_counter() - started
        metrics.tokens_per_s = metrics.num_tokens / max(metrics.step_s, 1e-9)
        return StepResult(True, metrics, filtered, [t.rollout_id for t in kept])

    def _filter(self, trajs: Sequence[Trajectory]) -> tuple[list[Trajectory], list[Filtered]]:
        kept, dropped = split_stale(trajs, self.version, self.algo.max_staleness)
        if self.algo.filter_zero_variance:
            kept, zero = split_zero_variance(kept)
            dropped += zero
        return kept, dropped

    def _plan(self, kept: list[Trajectory]) -> StepPlan:
        """Advantages and this rank's micro-batches; every normaliser is the whole step's.
        Only the first micro-batch is packed here (`step_batches.py`)."""
        groups = micro_batches(kept, self.cfg.micro_batch_tokens)
        check(groups)
        rows = [group_rows(g) for g in groups]
        mine, padding = self.parallel.share(rows)
        all_weights = self._token_weights(groups, len(kept))
        outcome = torch.tensor(
            group_relative(
                [t.reward for t in kept],
                [t.group_id for t in kept],
                normalize_std=self.algo.normalize_std,
            ),
            dtype=torch.float32,
        )
        if self.algo.kl_coef > 0 and self.reference is None:
            self.reference = self.parallel.frozen_copy(self.model)
        # under this version: rows it recomputed are replayed with the routes it used
        batches = StepBatches(groups, self.version, self.device)
        if mine:  # the first pass's batch: host-built, moved through pinned memory
            batches.prefetch(mine[0])
        return StepPlan(
            batches=batches,
            mine=mine,
            rows=rows,
            weights=[moved_without_sync(all_weights[i], self.device) for i in mine],
            outcome=moved_without_sync(outcome, self.device),
            use_critic=self.critic is not None and self.critic.ready,
            # the model's auxiliary losses are sums of per-sequence terms: averaging them
            # over the step's sequences keeps the step independent of the micro-batch split
            aux_scale=1.0 / sum(len(g) for g in groups),
            padding=padding,
        )

    def _passes(self, plan: StepPlan) -> TokenSums:
        """Every micro-batch's forward and backward (gradients accumulate), then the sums
        made global. The next micro-batch is packed while the device runs this one's
        forward (`StepBatches.prefetch`, before this one's backward)."""
        sums = TokenSums(has_reference=self.reference is not None)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        ahead = [*plan.mine[1:], None][: len(plan.mine)]  # a rank may have none (padding)
        for i, nxt, w in zip(plan.mine, ahead, plan.weights, strict=True):
            batch = plan.batches.on_device(i)
            prefetch = None if nxt is None else (lambda n=nxt: plan.batches.prefetch(n))
            self._micro_step(
                batch, w, plan.outcome, plan.use_critic, plan.aux_scale, sums, prefetch
            )
        if plan.padding:  # data parallel: a pass of weight 0 that changes no statistic
            smallest = min(range(len(plan.rows)), key=plan.rows.__getitem__)
            pad = plan.batches.host()[smallest].to(self.device)
            w0 = torch.zeros(pad.num_policy_tokens, device=self.device)
            for _ in range(plan.padding):
                with preserved_statistics(self.model):
                    self._micro_step(pad, w0, plan.outcome, plan.use_critic, 0.0, TokenSums())
        self.parallel.reduce_step(sums, self.model)
        return sums

    def _update(self) -> Tensor:
        """Clip, AdamW, the MoE balance update, the critic's update; the policy's grad norm."""
        grad_norm, divisor = self.parallel.clip(self.model, self.cfg.grad_clip)
        for group in self.optimizer.param_groups:
            group["lr"] = self.current_lr()
        with divided_gradients(self.optimizer, divisor):  # the clip, where it is folded in
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.model.update_balance()
        if self.critic is not None:
            self.parallel.reduce_critic(self.critic)  # replicated: summed over ranks
            self.critic.update()
        return grad_norm

    def _token_weights(self, groups: list[Group], num_samples: int) -> list[Tensor]:
        per_group = [policy_samples(g) for g in groups]
        weights = TOKEN_WEIGHTS[self.algo.aggregation](torch.cat(per_group), num_samples)
        return list(weights.split([len(p) for p in per_group]))

    def _micro_step(
        self,
        batch: PackedBatch,
        w_P: Tensor,
        outcome: Tensor,
        use_critic: bool,
        aux_scale: float,
        sums: TokenSums,
        before_backward: Callable[[], None] | None = None,
    ) -> None:
        aux = AuxLosses()
        h_Nd = packed_hidden(
            self.model, batch, self.cfg.replay_experts, aux, self.cfg.replay_selections
        )
        h_Pd = h_Nd[batch.pred_rows_P]
        out = self._log_probs(self.model, h_Pd, batch)
        critic_loss = torch.zeros((), device=self.device)
        adv_P = outcome[batch.sample_P] + batch.penalties_P
        if self.critic is not None:
            critic_loss, values_P = self.critic.loss(h_Pd, batch.returns_P, w_P)
            critic_loss.backward()
            if use_critic:
                adv_P = critic_advantages(batch.returns_P, values_P)
        ref_P = self._reference_log_probs(batch) if self.reference is not None else None
        pg_P, kl_P = per_token_terms(self.algo, out.logp_P, batch.behaviour_P, adv_P, ref_P)
        pg = (pg_P * w_P).sum()
        kl = (kl_P * w_P).sum() if kl_P is not None else torch.zeros((), device=self.device)
        loss = pg + self.algo.kl_coef * kl + aux.total() * aux_scale
        heads_loss = self._mtp_loss(h_Nd, batch, w_P)
        if before_backward is not None:  # host work while the device runs the forward
            before_backward()
        self.parallel.backward(loss, heads_loss)
        weighted = (loss.detach(), pg.detach(), kl.detach(), critic_loss.detach())
        fresh_P = batch.versions_P.to(out.logp_P.device) == self.version
        sums.add(out.logp_P, batch.behaviour_P, out.entropy_P, self.algo.tis_cap, weighted, fresh_P)

    def _mtp_loss(self, h_Nd: Tensor, batch: PackedBatch, w_P: Tensor) -> Tensor | None:
        """The MTP heads' weighted loss: its own graph over detached inputs, so it trains
        the heads' parameters only (`mtp_loss.py`); None when off or without targets."""
        if self.cfg.mtp_weight == 0:
            return None
        opts = self.logprob_options
        per_depth = mtp_nll(self.model, h_Nd, batch, opts.valid_vocab, opts.chunk)
        heads_loss = mtp_loss(per_depth, w_P)
        return None if heads_loss is None else self.cfg.mtp_weight * heads_loss

    def _log_probs(self, model: PolicyModel, h_Pd: Tensor, batch: PackedBatch) -> PolicyLogProbs:
        return policy_log_probs(
            model,
            h_Pd,
            batch.targets_P,
            batch.candidates_PC,
            batch.has_candidates_P,
            self.logprob_options,
        )

    def _reference_log_probs(self, batch: PackedBatch) -> Tensor:
        assert self.reference is not None
        with torch.no_grad():
            h = packed_hidden(
                self.reference, batch, self.cfg.replay_experts, None, self.cfg.replay_selections
            )
            return self._log_probs(self.reference, h[batch.pred_rows_P], batch).logp_P

    # ---- no-gradient recomputation (tests, alignment checks) -------------------------------

    def log_probs(
        self,
        trajectories: Sequence[Trajectory],
        replay: str | None = None,
        model: PolicyModel | None = None,
        selections: bool | None = None,
        version: int | None = None,
    ) -> list[Tensor]:
        """Recomputed log-probs of each trajectory's policy tokens (segment order), no grad.

        Uses `replay` and `selections` (default: the configured expert and selection replay)
        and the configured candidate replay, with `model` (default: the policy); runs in eval
        mode so MoE load statistics are not touched. `version`: the weights `model` holds, so
        rows that version recomputed replay its routes (`pack`).
        """
        # Under data parallel a collective (FSDP gathers each unit): every rank calls it
        # with the same arguments and computes every trajectory.
        mode = replay or self.cfg.replay_experts
        blocks = self.cfg.replay_selections if selections is None else selections
        model = model if model is not None else self.model
        per_sample: list[list[Tensor]] = [[] for _ in trajectories]
        with _eval(model), torch.no_grad():
            for items in micro_batches(trajectories, self.cfg.micro_batch_tokens):
                batch = pack(items, with_routes=mode != "off" or blocks, version=version)
                batch = batch.to(self.device)
                h = packed_hidden(model, batch, mode, selections=blocks)
                logp = self._log_probs(model, h[batch.pred_rows_P], batch).logp_P.cpu()
                sample_P = batch.sample_P.cpu()
                for s in sample_P.unique().tolist():
                    per_sample[s].append(logp[sample_P == s])
        return [torch.cat(p) if p else torch.zeros(0) for p in per_sample]

    def _recompute(
        self, trajectories: Sequence[Trajectory], model: PolicyModel, version: int
    ) -> list[Tensor]:
        return self.log_probs(trajectories, model=model, version=version)

    # ---- critic pre-training -----------------------------------------------------------------

    def pretrain_critic(self, trajectories: Sequence[Trajectory], steps: int) -> list[float]:
        """Fit the critic to the returns of collected trajectories; the policy is untouched
        (`critic_pretrain.fit_critic`; under data parallel a collective)."""
        return fit_critic(self, trajectories, steps)

    def current_lr(self) -> float:
        """Linear warm-up over `warmup_steps`, then `lr`. A fresh Adam's first updates are
        ~lr * sign(grad) for every weight (its second-moment estimate is one sample), which
        on a warm-started policy is a random perturbation of the whole model; measured on
        the quickstart: one step at 1e-3 took reward from 0.47 to 0."""
        return self.cfg.lr * min(1.0, (self.step + 1) / (self.cfg.warmup_steps + 1))

    # ---- state ---------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Under data parallel a collective; the model's and the optimiser's tensors are
        then full (gathered), the optimiser's keyed by parameter name."""
        state: dict[str, Any] = {
            "model": self.parallel.full_state(self.model),
            "optimizer": self.parallel.optimizer_state(self.model, self.optimizer),
            "step": self.step,
            "version": self.version,
            "stream_position": dict(self.stream_position),
        }
        if self.critic is not None:
            state["critic"] = self.critic.state_dict()
            state["critic_optimizer"] = self.critic.optimizer.state_dict()
        if self.reference is not None:
            state["reference"] = self.parallel.full_state(self.reference)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Under data parallel a collective: each rank keeps its shard of the full state."""
        self.parallel.load_state(self.model, state["model"])
        self.parallel.load_optimizer_state(self.model, self.optimizer, state["optimizer"])
        self.step, self.version = int(state["step"]), int(state["version"])
        self.stream_position = dict(state["stream_position"])
        if self.critic is not None and "critic" in state:
            self.critic.load_state_dict(state["critic"])
            self.critic.optimizer.load_state_dict(state["critic_optimizer"])
        if "reference" in state:
            self.reference = self.parallel.frozen_copy(self.model)
            self.parallel.load_state(self.reference, state["reference"])

    def save_checkpoint(
        self, path: str | Path, stream_position: dict[str, Any] | None = None
    ) -> Path:
        """Atomically write everything a resumed trainer needs (see `checkpoint.py`).

        Under data parallel a collective: every rank gathers, rank 0 writes, and no rank
        returns before the file is in place."""
        if stream_position is not None:
            self.stream_position = dict(stream_position)
        return self.parallel.save(path, self.state_dict())

    def restore(self, path: str | Path) -> dict[str, Any]:
        """Load a checkpoint into this trainer; returns the stream position it recorded."""
        self.load_state_dict(load_checkpoint(path))
        return dict(self.stream_position)


def _step_metrics(
    step: int,
    version: int,
    trajectories: Sequence[Trajectory],
    kept: list[Trajectory],
    filtered: list[Filtered],
) -> StepMetrics:
    """The step's metrics known before any pass: sample counts, rewards, staleness."""
    metrics = StepMetrics(step, version, len(kept), len(filtered))
    if trajectories:  # the behaviour policy's reward: every sample the step consumed
        metrics.reward_mean = sum(t.reward for t in trajectories) / len(trajectories)
    if kept:
        staleness = torch.tensor([float(version - t.min_version) for t in kept])
        metrics.staleness_mean = float(staleness.mean())
        metrics.staleness_max = int(staleness.max())
        metrics.reward_mean_kept = sum(t.reward for t in kept) / len(kept)
    return metrics


@contextmanager
def _eval(model: PolicyModel) -> Iterator[None]:
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)
