"""Engine benchmarks: cost of the batch-invariant path, batching speed-up, prefix-cache hits.

Usage: python benchmarks/bench_engine.py [--preset small] [--device cpu|cuda] [--threads N]
  [--sessions 16] [--prompt 64] [--gen 32] [--turns 3] [--context 1024]
Prints three markdown tables:
1. forward time of the same model with the invariant kernels (fixed-tile bmm, block
   attention, 8-chunk row-parallel tree) vs the fastest plain path (F.linear, SDPA): a full
   prefill of `--context` tokens (the trainer's path) and one decode step of `--sessions`
   sequences (the engine's path);
2. engine tokens/s with `--sessions` concurrent sessions vs the same sessions one at a time;
3. prefix-cache hit rate over `--turns` turns of each session.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from rlsys import kernels
from rlsys.config.engine import EngineConfig
from rlsys.config.model import preset
from rlsys.config.sampling import SamplingConfig
from rlsys.engine.api import GenerationRequest
from rlsys.engine.core import EngineCore
from rlsys.engine.runner import LocalRunner
from rlsys.kernels import fused
from rlsys.kernels.tp import RowParallel
from rlsys.model import Transformer


def _sdpa_block_attention(
    q: Tensor, k: Tensor, v: Tensor, visible: Tensor, scale: float
) -> tuple[Tensor, Tensor]:
    i, u, s, d = k.shape
    out = F.scaled_dot_product_attention(
        q,
        k.reshape(i, u * s, d),
        v.reshape(i, u * s, d),
        attn_mask=visible.reshape(i, q.shape[1], u * s),
        scale=scale,
    )
    return out.nan_to_num(0.0), q.new_zeros(i, q.shape[1], u, dtype=torch.float32)


@contextlib.contextmanager
def plain_kernels() -> Iterator[None]:
    """Swap the invariant kernels for the fastest plain ones (same math, other rounding)."""
    saved = (kernels.linear, kernels.block_attention, RowParallel.linear, fused.partials_ok)
    kernels.linear = lambda x, w: F.linear(x.to(w.dtype), w)  # type: ignore[assignment]
    kernels.block_attention = _sdpa_block_attention  # type: ignore[assignment]
    RowParallel.linear = lambda self, x, w: F.linear(x.to(w.dtype), w).float()  # type: ignore[assignment,method-assign]
    fused.partials_ok = lambda x: False  # type: ignore[assignment]  # the products above instead
    try:
        yield
    finally:
        kernels.linear, kernels.block_attention, RowParallel.linear, fused.partials_ok = saved  # type: ignore[method-assign]


def _time(fn, reps: int) -> float:  # type: ignore[no-untyped-def]
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def invariance_cost(model: Transformer, args: argparse.Namespace) -> None:
    dev, vocab = args.device, model.cfg.vocab_size
    tokens = torch.randint(0, vocab, (1, args.context), device=dev)
    ctx = [torch.randint(0, vocab, (args.prompt,), device=dev) for _ in range(args.sessions)]

    def prefill() -> None:
        with torch.inference_mode():
            model(tokens, with_mtp=False)

    def decode_step() -> float:
        caches = [model.new_cache(dev) for _ in ctx]
        with torch.inference_mode():
            model.forward_step(ctx, caches)
            step = [c[-1:] for c in ctx]
            return _time(lambda: model.forward_step(step, [_fork(c) for c in caches]), args.reps)

    rows = []
    for name in ("invariant", "plain"):
        with plain_kernels() if name == "plain" else contextlib.nullcontext():
            rows.append((name, _time(prefill, args.reps), decode_step()))
    print(f"\n| path | prefill {args.context} tok (s) | decode step, {args.sessions} seqs (ms) |")
    print("|---|---:|---:|")
    for name, pre, dec in rows:
        print(f"| {name} | {pre:.3f} | {dec * 1e3:.1f} |")
    (_, p_inv, d_inv), (_, p_plain, d_plain) = rows
    print(
        f"| invariant overhead | {100 * (p_inv / p_plain - 1):+.0f}% "
        f"| {100 * (d_inv / d_plain - 1):+.0f}% |"
    )


def _fork(cache):  # type: ignore[no-untyped-def]
    from rlsys.engine.runner import snapshot

    return snapshot(cache)


def _sessions(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [
        torch.randint(32, min(127, vocab), (args.prompt,), generator=gen).tolist()
        for _ in range(args.sessions)
    ]


def _core(model: Transformer, args: argparse.Namespace, max_running: int) -> EngineCore:
    ecfg = EngineConfig(
        max_running=max_running, max_context_tokens=args.context, device=args.device
    )
    return EngineCore(model.cfg, ecfg, LocalRunner(model.cfg, model.state_dict(), args.device))


def _run(core: EngineCore, reqs: list[GenerationRequest]) -> list:  # type: ignore[type-arg]
    for req in reqs:
        assert core.add(req) is None
    out = []
    while core.has_work():
        out += core.step()
    return out


def batching(model: Transformer, args: argparse.Namespace) -> None:
    params = SamplingConfig(max_tokens_per_turn=args.gen)
    prompts = _sessions(args, model.cfg.vocab_size)
    reqs = [GenerationRequest(f"r{i}", f"s{i}", p, params, seed=0) for i, p in enumerate(prompts)]
    results = {}
    for mode, max_running in (("one at a time", 1), (f"{args.sessions} concurrent", 16)):
        core = _core(model, args, max_running)
        start = time.perf_counter()
        if max_running == 1:
            done = [r for req in reqs for r in _run(core, [req])]
        else:
            done = _run(core, reqs)
        wall = time.perf_counter() - start
        results[mode] = (sum(len(r.token_ids) for r in done), wall)
    print(
        f"\n| sessions ({args.prompt}-token prompt, {args.gen} generated) | tokens | s | tokens/s |"
    )
    print("|---|---:|---:|---:|")
    for mode, (n, wall) in results.items():
        print(f"| {mode} | {n} | {wall:.2f} | {n / wall:.1f} |")
    (n1, w1), (n2, w2) = results.values()
    print(f"| speed-up | | | {(n2 / w2) / (n1 / w1):.1f}x |")


def prefix_hits(model: Transformer, args: argparse.Namespace) -> None:
    params = SamplingConfig(max_tokens_per_turn=args.gen)
    contexts = _sessions(args, model.cfg.vocab_size)
    core = _core(model, args, 16)
    start = time.perf_counter()
    for turn in range(args.turns):
        reqs = [
            GenerationRequest(f"s{i}:{turn}", f"s{i}", c, params, seed=0)
            for i, c in enumerate(contexts)
        ]
        done = {r.request_id: r for r in _run(core, reqs)}
        observation = list(b"<obs>result 42</obs>")
        contexts = [
            c + done[f"s{i}:{turn}"].token_ids + observation for i, c in enumerate(contexts)
        ]
    stats = core.stats()
    print(f"\n| multi-turn ({args.sessions} sessions x {args.turns} turns) | value |")
    print("|---|---:|")
    print(f"| prompt tokens | {stats.prompt_tokens} |")
    print(f"| prefix-cache hit tokens | {stats.prefix_cache_hit_tokens} |")
    print(f"| hit rate | {100 * stats.prefix_cache_hit_rate:.1f}% |")
    print(f"| forward rows computed | {stats.forward_rows} |")
    print(f"| wall s | {time.perf_counter() - start:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="small")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--gen", type=int, default=32)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--only", default="cost,batching,prefix")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = Transformer(preset(args.preset)).eval().to(args.device)
    print(f"preset {args.preset}, device {args.device}, threads {args.threads}")
    parts = {"cost": invariance_cost, "batching": batching, "prefix": prefix_hits}
    for name in args.only.split(","):
        parts[name](model, args)


if __name__ == "__main__":
    main()
