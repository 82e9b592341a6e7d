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
4. global gradient-norm clip (the policy's; the MTP heads' apart), AdamW, MoE balance update; step and policy version + 1.

Device: the trainer runs where the model's parameters are (CPU, or the GPU Ray gave its
actor). Packing builds on CPU and moves each micro-batch once; log-probs it returns to
callers are on CPU.

Data parallel (`data_parallel`, FSDP2: `data_parallel.py`, `fsdp.py`): every rank calls
`train_step` with the same trajectories and runs its share of the same micro-batches; the
weights, `aux_scale` and advantages are the whole batch's, the gradients are summed over
ranks, the metrics are global on every rank. Without it (or unsharded) nothing changes.

Invariants: the loss of a batch does not depend on how it is split into micro-batches
or over ranks (per-token weights are computed over the whole batch); at staleness 0 with
the engine's weights the recomputed log-probs equal the behaviour log-probs bitwise (replay
off or `indices_and_gates`), so importance weights are exactly 1; a resumed trainer is the same
trainer (model, optimisers, step, version, stream position, reference policy).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator, Sequence
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
from rlsys.model import AuxLosses, Transformer
from rlsys.model.policy import PolicyModel
from rlsys.trainer.batch import PackedBatch, micro_batches, pack
from rlsys.trainer.checkpoint import load_checkpoint, save_checkpoint
from rlsys.trainer.critic import Critic
from rlsys.trainer.data_parallel import (
    DataParallel,
    assign_micro_batches,
    preserved_statistics,
    reduce_count,
    reduce_expert_load,
    reduce_gradients,
    reduce_token_sums,
)
from rlsys.trainer.forward import packed_hidden
from rlsys.trainer.fsdp import (
    full_optimizer_state,
    full_state_dict,
    load_full_optimizer_state,
    load_full_state_dict,
    shard_policy,
)
from rlsys.trainer.logprobs import LogProbOptions, PolicyLogProbs, policy_log_probs
from rlsys.trainer.metrics import StepMetrics, TokenSums, candidate_set_sizes
from rlsys.trainer.mtp_loss import clip_policy_and_mtp, mtp_loss, mtp_nll
from rlsys.trainer.snapshots import VersionSnapshots, policy_columns, stale_sample
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


class Trainer:
    """Owns the policy's optimiser state, the optional critic and reference, and the counters.

    `temperature` must be the engine's sampling temperature, and `valid_vocab` (default: the
    model's vocabulary) the ids it may sample, so that recomputed log-probs are over the same
    distribution. Tokens with a recorded candidate set use that set instead (replay).

    `data_parallel`: shard the policy with FSDP2 over that mesh (every method that touches
    the policy is then a collective: all ranks call it with the same arguments).
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
        self.dp = data_parallel
        if data_parallel is not None:
            shard_policy(model, data_parallel.mesh)  # type: ignore[arg-type]
        model.set_activation_checkpointing(cfg.activation_checkpointing)
        self.device = next(model.parameters()).device
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay
        )
        self.critic = (
            Critic(model.cfg.d_model, algo.critic).to(self.device) if algo.critic.enabled else None
        )
        self.reference: PolicyModel | None = None  # snapshot taken at the first RL step
        # host copies of recent versions and a scratch model to recompute under them
        # under data parallel rank 0 measures the stale mismatch (the others gather with it)
        measures = data_parallel is None or data_parallel.rank == 0
        self.snapshots = VersionSnapshots(keep=algo.max_staleness, store=measures)
        self._scratch: PolicyModel | None = None
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
        if self.cfg.mismatch_rollouts:
            self._snapshot()  # the weights that version sampled
        kept, filtered = self._filter(trajectories)
        metrics = StepMetrics(self.step, self.version, len(kept), len(filtered))
        if trajectories:  # the behaviour policy's reward: every sample the step consumed
            metrics.reward_mean = sum(t.reward for t in trajectories) / len(trajectories)
        if not kept:
            return StepResult(False, metrics, filtered)
        staleness = torch.tensor([float(self.version - t.min_version) for t in kept])
        metrics.staleness_mean, metrics.staleness_max = (
            float(staleness.mean()),
            int(staleness.max()),
        )
        metrics.reward_mean_kept = sum(t.reward for t in kept) / len(kept)

        # under this version: rows it recomputed are replayed with the routes it used
        packed = [
            pack(items, version=self.version)
            for items in micro_batches(kept, self.cfg.micro_batch_tokens)
        ]
        mine, padding = self._share(packed)
        all_weights = self._token_weights(packed, len(kept))
        weights = [all_weights[i].to(self.device) for i in mine]
        batches = [packed[i].to(self.device) for i in mine]
        outcome = torch.tensor(
            group_relative(
                [t.reward for t in kept],
                [t.group_id for t in kept],
                normalize_std=self.algo.normalize_std,
            ),
            dtype=torch.float32,
            device=self.device,
        )
        use_critic = self.critic is not None and self.critic.ready
        if self.algo.kl_coef > 0 and self.reference is None:
            self.reference = self._frozen_copy()
        clamp_before = _clamped(self.model)

        sums = TokenSums(has_reference=self.reference is not None)
        total_rows = sum(b.num_tokens for b in packed)
        # The model's auxiliary losses are sums of per-sequence terms: averaging them over
        # the step's sequences keeps the step independent of the micro-batch split.
        aux_scale = 1.0 / sum(len(b.spans) for b in packed)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        for batch, w in zip(batches, weights, strict=True):
            self._micro_step(batch, w, outcome, use_critic, aux_scale, sums)
        if padding:  # FSDP's collectives need as many passes on every rank: weight 0
            pad = min(packed, key=lambda b: b.num_tokens).to(self.device)
            w0 = torch.zeros(pad.num_policy_tokens, device=self.device)
            for _ in range(padding):
                with preserved_statistics(self.model):
                    self._micro_step(pad, w0, outcome, use_critic, 0.0, TokenSums())
        if self.dp is not None:
            reduce_token_sums(sums, self.dp.group)
            reduce_expert_load(self.model, self.dp.group)
        grad_norm = clip_policy_and_mtp(self.model, self.cfg.grad_clip, self.dp is not None)
        for group in self.optimizer.param_groups:
            group["lr"] = self.current_lr()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.model.update_balance()
        if self.critic is not None:
            if self.dp is not None:  # a replicated module: its gradient summed over ranks
                reduce_gradients(self.critic, self.dp.group)
            self.critic.update()

        self.step += 1
        self.version += 1
        if self.cfg.mismatch_rollouts:
            self._snapshot()
            if self.snapshots.store:  # rank 0 alone under data parallel: its metrics report
                self._stale_mismatch(kept, self.version - 1, sums)
        if stream_position is not None:
            self.stream_position = dict(stream_position)
        sums.fill(metrics)
        metrics.candidate_set = candidate_set_sizes(packed)
        metrics.step, metrics.policy_version = self.step, self.version
        metrics.num_tokens = total_rows
        metrics.grad_norm = float(grad_norm)
        metrics.grad_clamp_clipped = _clamped(self.model) - clamp_before
        if self.dp is not None:
            metrics.grad_clamp_clipped = reduce_count(metrics.grad_clamp_clipped, self.dp.group)
        metrics.critic_baseline = use_critic
        metrics.step_s = time.perf_counter() - started
        metrics.tokens_per_s = total_rows / max(metrics.step_s, 1e-9)
        return StepResult(True, metrics, filtered, [t.rollout_id for t in kept])

    def _plain_model(self) -> PolicyModel:
        """An unsharded model of the policy's shape (recomputing in it is no collective);
        its initial values are overwritten, so it must not draw from the global RNG."""
        with torch.random.fork_rng(devices=[]):
            return Transformer(self.model.cfg).to(self.device)  # type: ignore[attr-defined]

    def _frozen_copy(self) -> PolicyModel:
        """The reference policy: a frozen copy of the current weights (sharded as the
        policy is under data parallel: gathered once, then each rank keeps its shard)."""
        if self.dp is None:
            return _frozen_copy(self.model)
        ref = self._plain_model()
        ref.load_state_dict(full_state_dict(self.model))
        for p in ref.parameters():
            p.requires_grad_(False)
        return shard_policy(ref, self.dp.mesh).eval()  # type: ignore[arg-type]

    def _snapshot(self) -> None:
        gather = (lambda: full_state_dict(self.model)) if self.dp is not None else None
        self.snapshots.take(self.version, self.model, gather)  # type: ignore[arg-type]

    def _filter(self, trajs: Sequence[Trajectory]) -> tuple[list[Trajectory], list[Filtered]]:
        kept, dropped = split_stale(trajs, self.version, self.algo.max_staleness)
        if self.algo.filter_zero_variance:
            kept, zero = split_zero_variance(kept)
            dropped += zero
        return kept, dropped

    def _share(self, packed: list[PackedBatch]) -> tuple[list[int], int]:
        """This rank's micro-batches (indices into `packed`) and its padding passes."""
        if self.dp is None:
            return list(range(len(packed))), 0
        shares = assign_micro_batches([b.num_tokens for b in packed], self.dp.world_size)
        mine = shares[self.dp.rank]
        return mine, max(len(s) for s in shares) - len(mine)

    def _token_weights(self, batches: list[PackedBatch], num_samples: int) -> list[Tensor]:
        sample_P = torch.cat([b.sample_P for b in batches])
        weights = TOKEN_WEIGHTS[self.algo.aggregation](sample_P, num_samples)
        return list(weights.split([b.num_policy_tokens for b in batches]))

    def _micro_step(
        self,
        batch: PackedBatch,
        w_P: Tensor,
        outcome: Tensor,
        use_critic: bool,
        aux_scale: float,
        sums: TokenSums,
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
        if self.dp is None:
            loss.backward()
            heads = self._mtp_loss(h_Nd, batch, w_P)
            if heads is not None:
                heads.backward()
        else:  # one backward: FSDP reshards the root (LM head, embedding) when it ends
            heads = self._mtp_loss(h_Nd, batch, w_P)
            (loss if heads is None else loss + heads).backward()
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

    def _stale_mismatch(self, kept: Sequence[Trajectory], version: int, sums: TokenSums) -> None:
        """Recompute a sample of rollouts older than `version` under the weights that
        sampled each of their tokens; add the differences to the step's mismatch."""
        sample = stale_sample(kept, version, self.cfg.mismatch_rollouts)
        if not sample:
            return
        if self._scratch is None:
            self._scratch = copy.deepcopy(self.model) if self.dp is None else self._plain_model()
        columns = [policy_columns(t) for t in sample]
        versions = sorted({v for vs, _ in columns for v in vs.tolist()} - {version})
        for v in (v for v in versions if v in self.snapshots):
            self.snapshots.load_into(self._scratch, v)
            recomputed = self.log_probs(sample, model=self._scratch, version=v)
            for logp, (vs, behaviour) in zip(recomputed, columns, strict=True):
                at_v = vs == v
                sums.add_mismatch(logp[at_v].float() - behaviour[at_v])

    # ---- critic pre-training -----------------------------------------------------------------

    def pretrain_critic(self, trajectories: Sequence[Trajectory], steps: int) -> list[float]:
        """Fit the critic to the returns of collected trajectories; the policy is untouched.

        Under data parallel a collective: every rank runs the whole (same) computation, so
        the replicated critic stays the same on every rank."""
        assert self.critic is not None, "algo.critic.enabled is off"
        losses = []
        batches = [
            pack(items, with_routes=False).to(self.device)
            for items in micro_batches(trajectories, self.cfg.micro_batch_tokens)
        ]
        weights = TOKEN_WEIGHTS["token_mean"](
            torch.cat([b.sample_P for b in batches]).cpu(), len(trajectories)
        ).to(self.device)
        hidden = []
        with _eval(self.model), torch.no_grad():
            for b in batches:
                hidden.append(packed_hidden(self.model, b, "off")[b.pred_rows_P])
        for _ in range(steps):
            total = 0.0
            for b, h, w in zip(
                batches, hidden, weights.split([b.num_policy_tokens for b in batches]), strict=True
            ):
                loss, _ = self.critic.loss(h, b.returns_P, w)
                loss.backward()
                total += float(loss.detach())
            self.critic.update()
            losses.append(total)
        return losses

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
        sharded = self.dp is not None
        state: dict[str, Any] = {
            "model": full_state_dict(self.model) if sharded else self.model.state_dict(),
            "optimizer": (
                full_optimizer_state(self.model, self.optimizer)  # type: ignore[arg-type]
                if sharded
                else self.optimizer.state_dict()
            ),
            "step": self.step,
            "version": self.version,
            "stream_position": dict(self.stream_position),
        }
        if self.critic is not None:
            state["critic"] = self.critic.state_dict()
            state["critic_optimizer"] = self.critic.optimizer.state_dict()
        if self.reference is not None:
            state["reference"] = (
                full_state_dict(self.reference) if sharded else self.reference.state_dict()
            )
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.dp is not None:  # a collective: each rank keeps its shard of the full state
            load_full_state_dict(self.model, state["model"])  # type: ignore[arg-type]
            load_full_optimizer_state(self.model, self.optimizer, state["optimizer"])
        else:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.version = int(state["step"]), int(state["version"])
        self.stream_position = dict(state["stream_position"])
        if self.critic is not None and "critic" in state:
            self.critic.load_state_dict(state["critic"])
            self.critic.optimizer.load_state_dict(state["critic_optimizer"])
        if "reference" in state:
            self.reference = self._frozen_copy()
            if self.dp is not None:
                load_full_state_dict(self.reference, state["reference"])  # type: ignore[arg-type]
            else:
                self.reference.load_state_dict(state["reference"])

    def save_checkpoint(
        self, path: str | Path, stream_position: dict[str, Any] | None = None
    ) -> Path:
        """Atomically write everything a resumed trainer needs (see `checkpoint.py`).

        Under data parallel a collective: every rank gathers, rank 0 writes, and no rank
        returns before the file is in place."""
        if stream_position is not None:
            self.stream_position = dict(stream_position)
        state = self.state_dict()
        if self.dp is None:
            return save_checkpoint(path, state)
        if self.dp.rank == 0:
            save_checkpoint(path, state)
        torch.distributed.barrier(group=self.dp.group)
        return Path(path)

    def restore(self, path: str | Path) -> dict[str, Any]:
        """Load a checkpoint into this trainer; returns the stream position it recorded."""
        self.load_state_dict(load_checkpoint(path))
        return dict(self.stream_position)


def _frozen_copy(model: PolicyModel) -> PolicyModel:
    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def _clamped(model: PolicyModel) -> int:
    return sum(clipped for clipped, _ in model.grad_clamp_counts())


@contextmanager
def _eval(model: PolicyModel) -> Iterator[None]:
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)
