"""Trainer throughput and peak memory: one `train_step` on long sequences, CPU.

Per configuration (sequence length x replay on/off x chunked/unchunked LM head), a fresh
subprocess builds the `small` model, a group of 2 synthetic engine-like trajectories (a
64-token prompt, then policy tokens to the full length; behaviour log-probs, routes and
top-64 candidate sets recorded by a no-grad recording forward, as the engine records
them), takes one warm-up step and then times `--repeat` steps. Peak memory is the
process's peak RSS (ru_maxrss) minus its RSS before the first step.

"replay on" = routed-expert replay (indices) + top-p candidate-set replay;
"replay off" = neither. "chunked" = LM head + log-softmax in 1024-row checkpointed chunks.

Usage: python benchmarks/bench_trainer.py [--lengths 1024,8192] [--threads 2] [--vocab N]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

from rlsys.config.algo import AlgoConfig
from rlsys.config.job import TrainerSection
from rlsys.config.model import preset
from rlsys.model import RoutingRecorder, Transformer
from rlsys.trainer import Trainer
from rlsys.trajectory import Segment, Trajectory

PROMPT = 64
CANDIDATES = 64


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def synthetic_group(model: Transformer, length: int, replay: bool) -> list[Trajectory]:
    trajs = []
    for m in range(2):
        tokens = torch.randint(0, min(model.cfg.vocab_size, 256), (length,))
        recorder = RoutingRecorder()
        with torch.no_grad():
            logits = model.forward_step([tokens], [model.new_cache()], recorder)[0]
        routes = recorder.routes()
        logp = torch.log_softmax(logits, -1)
        top = logits.topk(min(CANDIDATES, logits.shape[-1]), -1).indices
        seg = Segment()
        seg.append(tokens[:PROMPT].tolist(), turn=-1, policy=False)
        n = length - PROMPT
        rows = range(PROMPT - 1, length - 1)
        seg.append(
            tokens[PROMPT:].tolist(),
            turn=0,
            policy=True,
            logprobs=[float(logp[r, tokens[r + 1]]) for r in rows],
            versions=[0] * n,
            candidates=[sorted({*top[r].tolist(), int(tokens[r + 1])}) for r in rows]
            if replay
            else None,
            routed=[{"indices": routes.indices[:, r], "gates": routes.gates[:, r]} for r in rows]
            if replay
            else None,
        )
        trajs.append(Trajectory(f"r{m}", "g", "t", [seg], reward=float(m)))
    return trajs


def one(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = preset("small").with_overrides({"vocab_size": args.vocab} if args.vocab else {})
    model = Transformer(cfg)
    trajs = synthetic_group(model, args.length, args.replay == "on")
    section = TrainerSection(
        replay_experts="indices" if args.replay == "on" else "off",
        replay_candidates=args.replay == "on",
        lm_head_chunk=1024 if args.head == "chunked" else 0,
        micro_batch_tokens=args.length,
    )
    trainer = Trainer(model, section, AlgoConfig(max_staleness=10**6))
    base = rss_mb()
    trainer.train_step(trajs)  # warm-up
    times = []
    for _ in range(args.repeat):
        start = time.perf_counter()
        trainer.train_step(trajs)
        times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    tokens = 2 * args.length
    best = min(times)
    print(json.dumps({"tokens_per_s": tokens / best, "step_s": best, "peak_mb": peak - base}))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--lengths", default="1024,8192")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--vocab", type=int, default=0, help="override the preset's vocabulary")
    p.add_argument("--replays", default="off,on", help="replay settings to run")
    p.add_argument("--heads", default="chunked,unchunked", help="LM-head settings to run")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--length", type=int, default=1024, help=argparse.SUPPRESS)
    p.add_argument("--replay", default="off", help=argparse.SUPPRESS)
    p.add_argument("--head", default="chunked", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        one(args)
        return
    vocab = args.vocab or preset("small").vocab_size
    print(f"small preset, vocab {vocab}, threads {args.threads}, 2 sequences per step")
    print("| tokens/seq | replay | LM head | tokens/s | step s | peak MB over baseline |")
    print("|---:|---|---|---:|---:|---:|")
    for length in (int(x) for x in args.lengths.split(",")):
        for replay in args.replays.split(","):
            for head in args.heads.split(","):
                cmd = [
                    sys.executable,
                    __file__,
                    "--one",
                    f"--length={length}",
                    f"--replay={replay}",
                ]
                cmd += [f"--head={head}", f"--threads={args.threads}", f"--repeat={args.repeat}"]
                cmd += [f"--vocab={args.vocab}"]
                out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
                r = json.loads(out.strip().splitlines()[-1])
                print(
                    f"| {length} | {replay} | {head} | {r['tokens_per_s']:,.0f} "
                    f"| {r['step_s']:.2f} | {r['peak_mb']:,.0f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
