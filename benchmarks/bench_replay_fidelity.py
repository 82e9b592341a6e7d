"""Long-horizon replay fidelity at staleness 1-4: an ablation.

Per arm, a real `Trainer` (bf16 `tiny` model) takes `--steps` optimiser steps on
trajectories that a real `EngineCore` + `LocalRunner` generated in this process (no Ray)
with the weights of an older version: staleness cycles 1, 2, 3, 4. Each trajectory is one
segment: a prompt, then two policy turns (nucleus sampling, top_p 0.9) each followed by
observation tokens, recorded as the scaffold records them (context routes included). The
reward is the share of sampled ids in the lower half of the vocabulary, so groups have
variance and the policy moves. Arms (trainer settings; the engine records everything):

  no replay                 experts re-routed, full-vocabulary log-probs, no projection
  R3                        + routed experts replayed on every row (indices)
  R3 + candidate sets       + log-probs over the recorded top-p set
  + zero-center             + zero-center projection of the logit gradient
  + selections              + the engine's Sparse GQA block selections replayed

Columns: `mismatch` (the engine's log-prob against the trainer's recomputation under the
behaviour version's own weights, every stale rollout of every step: mean/max |diff| and K3
KL) and `drift` (behaviour against the current policy at the step: the mismatch plus the
policy's own updates; mean/max |diff|, K3 KL). The full-set arm also measures the
selection mismatch: per staleness, the share of (token, Sparse GQA layer, KV group)
selections where the current indexer picks other blocks than the engine did (over all rows,
and over the rows that have a choice: position // B > k / B), the share of (token, MoE
layer) expert sets that differ, and the mean |log-prob| change, at the current weights, of
replaying selections (with R3 on) and of replaying experts (with selections on).

Run (2-core CPU, ~minutes):  OMP_NUM_THREADS=1 python -m benchmarks.bench_replay_fidelity
"""

from __future__ import annotations

import argparse
import copy
import time
from collections import defaultdict
from dataclasses import dataclass

import torch

from rlsys.config.algo import AlgoConfig
from rlsys.config.engine import EngineConfig
from rlsys.config.job import TrainerSection
from rlsys.config.model import ModelConfig, preset
from rlsys.config.sampling import SamplingConfig
from rlsys.engine.api import GenerationRequest
from rlsys.engine.core import EngineCore
from rlsys.engine.runner import LocalRunner
from rlsys.model import RoutingRecorder, Transformer
from rlsys.model.attention import SeqSpan
from rlsys.model.routing import pad_blocks
from rlsys.trainer import Trainer
from rlsys.trainer.batch import micro_batches, pack
from rlsys.trajectory import Segment, Trajectory

ARMS: dict[str, dict[str, object]] = {
    "no replay": dict(
        replay_experts="off", replay_candidates=False, zero_center=False, replay_selections=False
    ),
    "R3": dict(
        replay_experts="indices",
        replay_candidates=False,
        zero_center=False,
        replay_selections=False,
    ),
    "R3 + candidate sets": dict(
        replay_experts="indices", replay_candidates=True, zero_center=False, replay_selections=False
    ),
    "+ zero-center": dict(
        replay_experts="indices", replay_candidates=True, zero_center=True, replay_selections=False
    ),
    "+ selections": dict(
        replay_experts="indices", replay_candidates=True, zero_center=True, replay_selections=True
    ),
}


@dataclass(frozen=True)
class Shape:
    groups: int = 4
    group_size: int = 4
    prompt_len: int = 16
    turns: int = 2
    tokens_per_turn: int = 8
    obs_len: int = 4
    top_p: float = 0.9


def generate(
    runner: LocalRunner, cfg: ModelConfig, version: int, shape: Shape, seed: int
) -> list[Trajectory]:
    """Every trajectory's turns through one `EngineCore` serving `version` (batched)."""
    engine_cfg = EngineConfig(seed=seed, max_context_tokens=4096, record_selections=True)
    core = EngineCore(cfg, engine_cfg, runner, version)
    rng = torch.Generator().manual_seed(seed)
    segs: dict[str, Segment] = {}
    for g in range(shape.groups):
        prompt = torch.randint(0, cfg.vocab_size, (shape.prompt_len,), generator=rng).tolist()
        for m in range(shape.group_size):
            segs[f"{g}-{m}"] = Segment()
            segs[f"{g}-{m}"].append(prompt, turn=-1, policy=False)
    sampling = SamplingConfig(max_tokens_per_turn=shape.tokens_per_turn, top_p=shape.top_p)
    for turn in range(shape.turns):
        for sid, seg in segs.items():
            core.add(GenerationRequest(f"{sid}-{turn}", sid, list(seg.token_ids), sampling))
        results = []
        while core.has_work():
            results += core.step()
        for r in results:
            seg = segs[r.request_id.rsplit("-", 1)[0]]
            assert r.error is None, r.error
            seg.fill_context_routes(r.prompt_routed_experts)
            seg.append_generation(r, turn=turn)
            obs = torch.randint(0, cfg.vocab_size, (shape.obs_len,), generator=rng).tolist()
            seg.append(obs, turn=turn, policy=False)
    half = cfg.vocab_size // 2
    trajs = []
    for sid, seg in segs.items():
        sampled = [t for t, p in zip(seg.token_ids, seg.policy_mask, strict=True) if p]
        reward = sum(t < half for t in sampled) / len(sampled)
        trajs.append(Trajectory(sid, sid.split("-")[0], "bench", [seg], reward=reward))
    return trajs


def decision_mismatch(trainer: Trainer, trajs: list[Trajectory]) -> dict[str, float]:
    """Selection and expert-route disagreement of the current weights with the engine's, and
    the log-prob effect of replaying each (see module doc)."""
    model = trainer.model
    cfg = model.cfg
    sel_diff = sel_rows = choice_diff = choice_rows = exp_diff = exp_rows = 0
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for items in micro_batches(trajs, trainer.cfg.micro_batch_tokens):
            batch = pack(items)
            spans = [SeqSpan(row, n, 0) for row, n in batch.spans]
            rec = RoutingRecorder(blocks=True)
            model.hidden_packed(batch.tokens_N, spans, rec)
            now, then = rec.routes(), batch.routes
            assert then is not None and then.blocks is not None and now.blocks is not None
            rows = batch.routed_rows_N
            width = max(now.blocks.shape[-1], then.blocks.shape[-1])
            differ = (pad_blocks(now.blocks, width) != pad_blocks(then.blocks, width)).any(-1)
            differ = differ[:, rows]  # (S, rows, Hkv)
            positions = torch.cat([torch.arange(n) for _, n in batch.spans])[rows]
            choice = (positions // cfg.sparse_block > cfg.sparse_selected_blocks)[None, :, None]
            choice = choice.expand_as(differ)
            sel_diff += int(differ.sum())
            sel_rows += differ.numel()
            choice_diff += int(differ[choice].sum())
            choice_rows += int(choice.sum())
            e_now = now.indices[:, rows].sort(-1).values
            e_then = then.indices[:, rows].sort(-1).values
            exp_diff += int((e_now != e_then).any(-1).sum())
            exp_rows += e_now.shape[0] * e_now.shape[1]
    model.train(was_training)
    full = torch.cat(trainer.log_probs(trajs, replay="indices", selections=True))
    no_sel = torch.cat(trainer.log_probs(trajs, replay="indices", selections=False))
    no_r3 = torch.cat(trainer.log_probs(trajs, replay="off", selections=True))
    return {
        "selection_differ": sel_diff / max(sel_rows, 1),
        "selection_differ_with_choice": choice_diff / max(choice_rows, 1),
        "experts_differ": exp_diff / max(exp_rows, 1),
        "selection_effect_mean": float((full - no_sel).abs().mean()),
        "selection_effect_max": float((full - no_sel).abs().max()),
        "routing_effect_mean": float((full - no_r3).abs().mean()),
        "routing_effect_max": float((full - no_r3).abs().max()),
    }


def run_arm(
    name: str, steps: int, shape: Shape, lr: float, seed: int, measure: bool
) -> tuple[dict[str, float], dict[int, dict[str, float]]]:
    cfg = preset("tiny").with_overrides({"compute_dtype": "bfloat16"})
    torch.manual_seed(seed)
    model = Transformer(cfg)
    section = TrainerSection(
        lr=lr, warmup_steps=0, mismatch_rollouts=shape.groups * shape.group_size, **ARMS[name]
    )
    algo = AlgoConfig(max_staleness=4, filter_zero_variance=True)
    trainer = Trainer(model, section, algo)
    runner = LocalRunner(cfg, model.state_dict(), record_selections=True)
    states = {0: copy.deepcopy(model.state_dict())}
    rows: list[dict[str, float]] = []
    by_staleness: dict[int, list[dict[str, float]]] = defaultdict(list)
    for step in range(steps):
        behaviour = max(0, trainer.version - (1 + step % 4))
        runner.load_state_dict(states[behaviour])
        trajs = generate(runner, cfg, behaviour, shape, seed=1000 * seed + step)
        staleness = trainer.version - behaviour
        if measure and staleness > 0:
            by_staleness[staleness].append(decision_mismatch(trainer, trajs))
        result = trainer.train_step(trajs)
        m = result.metrics
        if result.stepped and staleness > 0 and m.mismatch is not None:
            rows.append(
                {
                    "mismatch_mean": m.mismatch["mean_abs"],
                    "mismatch_max": m.mismatch["max_abs"],
                    "mismatch_k3": m.mismatch["k3_kl"],
                    "drift_mean": m.logprob_drift_mean_abs,
                    "drift_max": m.logprob_drift_max_abs,
                    "drift_k3": m.kl,
                    "reward": m.reward_mean,
                }
            )
        states[trainer.version] = copy.deepcopy(model.state_dict())
        for old in [v for v in states if v < trainer.version - 4]:
            del states[old]
    summary = {
        key: (max if key.endswith("_max") else _mean)([r[key] for r in rows]) for key in rows[0]
    }
    summary["steps"] = len(rows)
    summary["reward_first"] = _mean([r["reward"] for r in rows[:5]])
    summary["reward_last"] = _mean([r["reward"] for r in rows[-5:]])
    per_staleness = {
        s: {
            k: _mean([d[k] for d in ds]) if "mean" in k or "differ" in k else max(d[k] for d in ds)
            for k in ds[0]
        }
        for s, ds in sorted(by_staleness.items())
    }
    return summary, per_staleness


def _mean(xs: list[float]) -> float:
    return sum(xs) / max(len(xs), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=52)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arms", default=",".join(ARMS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    shape = Shape()
    print(
        f"tiny preset, bf16, {args.steps} steps, staleness 1-4 (cycling), lr {args.lr}, "
        f"{shape.groups}x{shape.group_size} rollouts/step, top_p {shape.top_p}"
    )
    head = (
        "| arm | mismatch mean abs | mismatch max abs | mismatch K3 | drift mean abs | "
        "drift max abs | drift K3 | reward first->last | s |"
    )
    lines = [head, "|" + "---|" * 9]
    measured: dict[int, dict[str, float]] = {}
    for name in args.arms.split(","):
        started = time.perf_counter()
        s, per = run_arm(name, args.steps, shape, args.lr, args.seed, name == "+ selections")
        measured = per or measured
        lines.append(
            f"| {name} | {s['mismatch_mean']:.2e} | {s['mismatch_max']:.2e} | "
            f"{s['mismatch_k3']:.2e} | {s['drift_mean']:.2e} | {s['drift_max']:.2e} | "
            f"{s['drift_k3']:.2e} | {s['reward_first']:.3f}->{s['reward_last']:.3f} | "
            f"{time.perf_counter() - started:.0f} |"
        )
        print(lines[-1], flush=True)
    print("\n".join(lines))
    if measured:
        print(
            "\n| staleness | selections differ (all rows) | (rows with a choice) | "
            "expert sets differ | selection replay: mean / max abs dlogp | "
            "expert replay: mean / max abs dlogp |"
        )
        print("|" + "---|" * 6)
        for st, d in measured.items():
            print(
                f"| {st} | {d['selection_differ']:.3f} | {d['selection_differ_with_choice']:.3f} | "
                f"{d['experts_differ']:.3f} | {d['selection_effect_mean']:.2e} / "
                f"{d['selection_effect_max']:.2e} | {d['routing_effect_mean']:.2e} / "
                f"{d['routing_effect_max']:.2e} |"
            )


if __name__ == "__main__":
    main()
