"""Admission policies compared on multi-turn sessions: prefix-cache hit rate and tokens/s.

Same run, same sessions, same engines (weights shared), one policy after the other:
`session_affine` (a session stays on its replica), `round_robin`, `least_loaded`. Each
session runs `--turns` turns; a turn's prompt is the previous context + its generated
tokens + a short observation, as an agent's context grows. Engines are in-process
`InferenceEngine`s (the same objects the Ray replica actors wrap); requests go through the
real `AdmissionScheduler` and `AdmittedGenerator`.

    .venv/bin/python benchmarks/bench_admission.py [--preset small] [--replicas 2]
        [--sessions 16] [--turns 3] [--gen 16]
"""

from __future__ import annotations

import argparse
import random
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from rlsys.config.engine import EngineConfig
from rlsys.config.model import preset
from rlsys.config.sampling import SamplingConfig
from rlsys.engine.api import GenerationRequest
from rlsys.engine.engine import InferenceEngine
from rlsys.model import Transformer
from rlsys.rollout.admission import AdmissionScheduler
from rlsys.rollout.client import AdmittedGenerator


def run_policy(policy: str, engines: dict, args: argparse.Namespace) -> dict:
    sched = AdmissionScheduler(
        list(engines), max_running=args.max_running, max_queue=256, policy=policy
    )
    events: list[str] = []
    client = AdmittedGenerator(sched, engines, lambda kind, data: events.append(kind))
    before = {r: e.stats() for r, e in engines.items()}

    def session(i: int) -> int:
        rng = random.Random(i)
        ctx = [rng.randrange(256) for _ in range(args.prompt)]
        made = 0
        for turn in range(args.turns):
            req = GenerationRequest(
                f"{policy}-{i}-{turn}",
                f"{policy}-s{i}",
                list(ctx),
                SamplingConfig(max_tokens_per_turn=args.gen),
                seed=i * 100 + turn,
            )
            out = client.generate(req)
            made += len(out.token_ids)
            ctx += out.token_ids + [rng.randrange(256) for _ in range(args.obs)]
        return made

    start = time.perf_counter()
    with ThreadPoolExecutor(args.sessions) as pool:
        tokens = sum(pool.map(session, range(args.sessions)))
    wall = time.perf_counter() - start
    after = {r: e.stats() for r, e in engines.items()}
    hit = sum(after[r].prefix_cache_hit_tokens - before[r].prefix_cache_hit_tokens for r in engines)
    prompt = sum(after[r].prompt_tokens - before[r].prompt_tokens for r in engines)
    return {
        "policy": policy,
        "tokens": tokens,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "hit_rate": hit / prompt if prompt else 0.0,
        "migrations": events.count("migration"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--gen", type=int, default=16)
    p.add_argument("--obs", type=int, default=16)
    p.add_argument("--max-running", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cfg = preset(args.preset)
    torch.manual_seed(0)
    state = Transformer(cfg).state_dict()
    rows = []
    for policy in ("session_affine", "round_robin", "least_loaded"):
        # Fresh replicas per policy (same weights): every policy starts with cold caches.
        engines = {
            f"replica-{i}": InferenceEngine(
                cfg, EngineConfig(max_running=args.max_running, seed=i), state=state
            )
            for i in range(args.replicas)
        }
        rows.append(run_policy(policy, engines, args))
        for e in engines.values():
            e.close()
    print(
        f"preset {args.preset}, {args.replicas} replicas, {args.sessions} sessions x {args.turns} turns, "
        f"prompt {args.prompt}, {args.gen} generated + {args.obs} observation tokens per turn"
    )
    print("| policy | prefix-cache hit rate | tokens/s | wall s |")
    print("|---|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['policy']} | {r['hit_rate']:.1%} | {r['tokens_per_s']:.1f} | {r['wall_s']:.1f} |"
        )


if __name__ == "__main__":
    main()
