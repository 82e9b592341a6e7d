"""Engine decode throughput on the GPU: the paged Triton path through `EngineCore`.

Usage (GPU machine): python benchmarks/bench_engine_gpu.py [--preset medium]
    [--batches 1,16,64] [--prompt 1024] [--gen 64]

For each batch size: `batch` requests of a `--prompt`-token prompt each generate `--gen`
tokens; the table gives decode tokens/s (after all prefills), the share of a decode step
spent in the model forward (the rest is sampling and bookkeeping on the host), and HBM
utilisation = bytes a decode step must read (every weight a step touches + the K/V its
attention reads) / step time, against 4.8 TB/s.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlsys.config.model import preset  # noqa: E402
from rlsys.engine.api import GenerationRequest, SamplingParams  # noqa: E402
from rlsys.engine.config import EngineConfig  # noqa: E402
from rlsys.engine.core import EngineCore  # noqa: E402
from rlsys.engine.runners import make_runner  # noqa: E402
from rlsys.engine.tp_dist import DistTPRunner  # noqa: E402
from rlsys.model import Transformer  # noqa: E402


def step_bytes(model: Transformer, batch: int, context: int) -> float:
    """Weights a decode step touches (all experts once batch >= experts / top-k) + K/V read."""
    cfg = model.cfg
    per_expert = 3 * cfg.d_model * cfg.expert_hidden * model.lm_head.element_size()
    routed = min(cfg.n_experts, batch * cfg.experts_per_token)
    expert_params = sum(p.numel() for n, p in model.named_parameters() if ".ffn.w" in n)
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) - expert_params * 2
    weights += cfg.n_layers * routed * per_expert - sum(
        p.numel() * p.element_size() for p in model.mtp.parameters()
    )
    kinds = cfg.layer_kinds()
    kv_tok = 2 * cfg.n_kv_groups * cfg.head_dim * 2
    swa = kinds.count("swa") * min(context, cfg.swa_window) * kv_tok
    sparse = kinds.count("sparse") * (
        min(context, cfg.sparse_topk) * kv_tok + context // cfg.sparse_block * cfg.index_dim * 4
    )
    return weights + batch * (swa + sparse)


def make(model: Transformer, batch: int, args: argparse.Namespace, tp: int, reduce: str):  # noqa: ANN201
    ecfg = EngineConfig(
        max_running=batch, max_context_tokens=args.prompt + args.gen + 8, device="cuda",
        max_step_tokens=max(batch, 4096), prefix_cache_tokens=0, tp=tp,
        tp_backend="nccl" if tp > 1 else "threads",
    )  # fmt: skip
    if tp > 1:
        runner = DistTPRunner(model.cfg, model.state_dict(), tp, "nccl", ecfg.kv_pages(), reduce)
    else:
        runner = make_runner(model.cfg, ecfg, model.state_dict())
    return ecfg, runner


def run(
    model: Transformer, batch: int, args: argparse.Namespace, runner, ecfg, gen: int
) -> dict[str, float]:  # noqa: ANN001
    core = EngineCore(model.cfg, ecfg, runner)
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=gen, seed=0)
    for i in range(batch):
        prompt = torch.randint(32, 127, (args.prompt,), generator=g).tolist()
        assert core.add(GenerationRequest(f"r{i}", f"s{i}", prompt, params)) is None
    forward_s, steps, tokens, decode_s = 0.0, 0, 0, 0.0
    orig = runner.step

    def timed_step(keys, chunks):  # noqa: ANN001, ANN202
        nonlocal forward_s
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = orig(keys, chunks)
        torch.cuda.synchronize()
        forward_s += time.perf_counter() - t0
        return out

    runner.step = timed_step  # type: ignore[method-assign]
    while core.has_work():  # (a finished request's cache is freed: runners are reusable)
        prefilling = any(s.num_generated == 0 for s in core.running) or core.waiting
        before = core.generated_tokens
        forward_before = forward_s
        t0 = time.perf_counter()
        core.step()
        if not prefilling:
            decode_s += time.perf_counter() - t0
            tokens += core.generated_tokens - before
            steps += 1
        else:
            forward_s = forward_before
    runner.step = orig  # type: ignore[method-assign]
    step_ms = 1000 * decode_s / max(steps, 1)
    return {
        "tok_s": tokens / decode_s if decode_s else 0.0,
        "step_ms": step_ms,
        "forward_share": forward_s / decode_s if decode_s else 0.0,
        "hbm": step_bytes(model, batch, args.prompt) / (step_ms * 1e-3) / 4.8e12,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="medium")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--gen", type=int, default=64)
    parser.add_argument("--tp", default="1", help="comma list of TP degrees (NCCL, one GPU each)")
    parser.add_argument("--reduce", default="tree", help="comma list: tree (invariant), allreduce")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = Transformer(preset(args.preset)).cuda().eval()
    print(
        f"preset {args.preset}: {model.num_parameters():,} parameters; {torch.cuda.get_device_name()}"
    )
    print(
        "\n| TP | reduction | batch | context | decode tokens/s | step ms | forward share | HBM util |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for tp in (int(t) for t in args.tp.split(",")):
        for reduce in args.reduce.split(",") if tp > 1 else ["-"]:
            for batch in (int(b) for b in args.batches.split(",")):
                ecfg, runner = make(model, batch, args, tp, reduce if tp > 1 else "tree")
                try:
                    run(model, batch, args, runner, ecfg, 4)  # warm-up: compiles every kernel
                    r = run(model, batch, args, runner, ecfg, args.gen)
                finally:
                    runner.close()
                print(
                    f"| {tp} | {reduce} | {batch} | {args.prompt} | {r['tok_s']:.0f} | {r['step_ms']:.1f} "
                    f"| {r['forward_share']:.0%} | {r['hbm']:.1%} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
