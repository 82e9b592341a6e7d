"""Trainer tokens/s and MFU on one GPU: `train_step` on long engine-like sequences.

Usage (GPU machine): python benchmarks/bench_trainer_gpu.py [--preset large]
    [--lengths 8192,32768] [--checkpointing off,on] [--repeat 2]

Per (sequence length, activation checkpointing): one trajectory of that length (a 256-token
prompt, then policy tokens; behaviour log-probs, routed experts and top-64 candidate sets
recorded by a no-grad packed forward, as the engine records them), replay on, chunked LM
head, one warm-up step, then `--repeat` timed steps (the best is shown). Model FLOPs per
token = 6 x active parameters in matrix products (routed top-k + shared experts,
projections, index projections, LM head) + attention: 12 x heads x head_dim x keys seen per
layer (the SWA window, or Sparse GQA's selected top-k keys) + the indexer's block scores
(6 x groups x index_dim x past blocks). MFU = model FLOPs / step time / 989 TFLOP/s (the
H200's dense bf16 peak); recomputation under checkpointing is not counted as useful work.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlsys.config.algo import AlgoConfig  # noqa: E402
from rlsys.config.job import TrainerSection  # noqa: E402
from rlsys.config.model import ModelConfig, preset  # noqa: E402
from rlsys.model import RoutingRecorder, Transformer  # noqa: E402
from rlsys.trainer import Trainer  # noqa: E402
from rlsys.trajectory import Segment, Trajectory  # noqa: E402

PROMPT, CANDIDATES, PEAK_FLOPS = 256, 64, 989e12


def model_flops(model: Transformer, length: int) -> float:
    """Forward + backward model FLOPs of one sequence of `length` tokens (see module doc)."""
    cfg = model.cfg
    matmul = model.num_parameters(active=True) - model.embed.numel()
    attn = 0.0
    for kind in cfg.layer_kinds():
        for t in range(0, length, 64):  # keys seen, summed in steps of 64 positions
            keys = min(t + 1, cfg.swa_window if kind == "swa" else cfg.sparse_topk)
            attn += 64 * 12 * cfg.n_heads * cfg.head_dim * keys
            if kind == "sparse":
                attn += 64 * 6 * cfg.n_kv_groups * cfg.index_dim * (t // cfg.sparse_block)
    return 6.0 * matmul * length + attn


def trajectory(model: Transformer, length: int) -> Trajectory:
    tokens = torch.randint(0, min(model.cfg.vocab_size, 256), (length,), device="cuda")
    recorder = RoutingRecorder()
    with torch.no_grad():
        logits = model(tokens[None], routing=recorder, with_mtp=False).logits[0]
        logp = torch.log_softmax(logits, -1)
        top = logits.topk(CANDIDATES, -1).indices
    routes = recorder.routes()
    idx, gates = routes.indices.cpu(), routes.gates.cpu()
    rows = range(PROMPT - 1, length - 1)
    targets = tokens[PROMPT:]
    picked = logp[PROMPT - 1 : length - 1].gather(-1, targets[:, None])[:, 0].cpu().tolist()
    top_h, targets_h = top.cpu().tolist(), targets.cpu().tolist()
    seg = Segment()
    seg.append(tokens[:PROMPT].tolist(), turn=-1, policy=False)
    seg.append(
        targets_h,
        turn=0,
        policy=True,
        logprobs=picked,
        versions=[0] * len(targets_h),
        candidates=[sorted({*top_h[r], targets_h[j]}) for j, r in enumerate(rows)],
        routed=[{"indices": idx[:, r], "gates": gates[:, r]} for r in rows],
    )
    return Trajectory("r0", "g", "t", [seg], reward=1.0)


def one(cfg: ModelConfig, length: int, checkpointing: bool, repeat: int) -> dict[str, float]:
    torch.manual_seed(0)
    model = Transformer(cfg).cuda()
    trajs = [trajectory(model, length), trajectory(model, length)]
    trajs[1].reward = 0.0  # a group with variance: the step is not filtered
    section = TrainerSection(
        replay_experts="indices",
        replay_candidates=True,
        lm_head_chunk=1024,
        micro_batch_tokens=length,
        activation_checkpointing=checkpointing,
        mismatch_rollouts=0,
    )
    trainer = Trainer(model, section, AlgoConfig(max_staleness=10**6))
    trainer.train_step(trajs)  # warm-up: compiles every kernel
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        trainer.train_step(trajs)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    best = min(times)
    tokens = 2 * length
    return {
        "tok_s": tokens / best,
        "step_s": best,
        "mfu": 2 * model_flops(model, length) / best / PEAK_FLOPS,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="large")
    p.add_argument("--lengths", default="8192,32768")
    p.add_argument("--checkpointing", default="off,on")
    p.add_argument("--repeat", type=int, default=2)
    args = p.parse_args()
    cfg = preset(args.preset)
    model = Transformer(cfg)
    print(
        f"preset {args.preset}: {model.num_parameters():,} parameters "
        f"({model.num_parameters(active=True):,} active), {cfg.compute_dtype}; "
        f"{torch.cuda.get_device_name()}; 2 sequences per step, replay on, chunked LM head"
    )
    del model
    print("\n| tokens/seq | activation ckpt | tokens/s | step s | MFU | peak GiB |")
    print("|---:|---|---:|---:|---:|---:|")
    for length in (int(x) for x in args.lengths.split(",")):
        for ckpt in args.checkpointing.split(","):
            try:
                r = one(cfg, length, ckpt == "on", args.repeat)
                print(
                    f"| {length} | {ckpt} | {r['tok_s']:,.0f} | {r['step_s']:.2f} "
                    f"| {r['mfu']:.1%} | {r['peak_gib']:.1f} |",
                    flush=True,
                )
            except torch.OutOfMemoryError:
                print(f"| {length} | {ckpt} | out of memory | | | |", flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
