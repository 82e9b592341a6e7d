"""MTP speculative decoding on the CPU: acceptance rate and speed-up against plain decoding.

A `small` policy warm-started on the quickstart task (`benchmarks/warm_small.py`; its MTP
head trained by the warm start's MTP loss) generates the first turn of held-out arithmetic
prompts (quickstart sampling: temperature 1, top-p 0.95, cap 32) with the engine core,
speculative_tokens 0 (plain) and 1 (MTP depth of `small`), at batch 1 and 16. Every run
checks that the tokens and log-probs are identical between the two modes.

Usage: OMP_NUM_THREADS=1 python benchmarks/bench_mtp_spec.py [--warm-steps 120]
    [--cache /tmp/rlsys15b_cache] [--requests 16] [--max-tokens 40] [--runs 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.warm_small import demonstrations, warm_small  # noqa: E402
from rlsys.config.engine import EngineConfig  # noqa: E402
from rlsys.config.sampling import SamplingConfig  # noqa: E402
from rlsys.engine.api import GenerationRequest, GenerationResult  # noqa: E402
from rlsys.engine.core import EngineCore  # noqa: E402
from rlsys.engine.runners import make_runner  # noqa: E402
from rlsys.tokenizer import VOCAB_SIZE  # noqa: E402


def prompts(warm, n: int) -> list[list[int]]:  # type: ignore[no-untyped-def]
    out = []
    for demo in demonstrations(warm.task, 4242, n, 0.0):
        seg = demo.segments[0]
        out.append(seg.token_ids[: seg.policy_mask.index(True)])
    return out


def run(warm, prompt_ids: list[list[int]], k: int, batch: int, max_tokens: int):  # type: ignore[no-untyped-def]
    ecfg = EngineConfig(
        max_running=batch,
        max_context_tokens=384,
        candidate_cap=32,
        sample_vocab=VOCAB_SIZE,
        speculative_tokens=k,
    )
    core = EngineCore(warm.cfg, ecfg, make_runner(warm.cfg, ecfg, warm.state))
    for i, p in enumerate(prompt_ids):
        params = SamplingConfig(max_tokens_per_turn=max_tokens, temperature=1.0, top_p=0.95)
        core.add(GenerationRequest(f"r{i}", f"r{i}", p, params, seed=i))
    done: dict[str, GenerationResult] = {}
    started = time.perf_counter()
    while core.has_work():
        done.update({r.request_id: r for r in core.step()})
    seconds = time.perf_counter() - started
    return done, seconds, core.stats()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--warm-steps", type=int, default=120)
    ap.add_argument("--cache", type=Path, default=Path("/tmp/rlsys15b_cache"))
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    warm = warm_small(args.warm_steps, args.cache)
    ps = prompts(warm, args.requests)
    print(
        "| batch | k | tokens/s (runs) | forward steps / token | rows / token | accepted | speed-up |"
    )
    print("|---|---|---|---|---|---|---|")
    for batch in (1, 16):
        base: dict[str, GenerationResult] = {}
        plain_rate = 0.0
        for k in (0, 1):
            rates, stats = [], None
            for _ in range(args.runs):
                done, seconds, stats = run(warm, ps, k, batch, args.max_tokens)
                rates.append(stats.generated_tokens / seconds)
                if not base:
                    base = done
                for rid, res in done.items():
                    assert res.token_ids == base[rid].token_ids, "spec changed the tokens"
                    assert res.logprobs == base[rid].logprobs, "spec changed the log-probs"
            rate = statistics.median(rates)
            plain_rate = plain_rate or rate
            accepted = (
                f"{stats.accepted_draft_tokens / stats.draft_tokens:.2f}"
                if stats.draft_tokens
                else "-"
            )
            spread = "/".join(f"{r:.0f}" for r in sorted(rates))
            print(
                f"| {batch} | {k} | {rate:.0f} ({spread}) | "
                f"{stats.steps / stats.generated_tokens:.3f} | "
                f"{stats.forward_rows / stats.generated_tokens:.2f} | {accepted} | "
                f"{rate / plain_rate:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
