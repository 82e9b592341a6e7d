"""Where an engine decode step's time goes on the GPU (torch profiler), batch 1, `medium`.

Usage (GPU machine): python benchmarks/profile_decode_gpu.py [--batch 1] [--steps 5] [--graphs]
    [--preset medium] [--context 1024]
Prints the top host-side ops by self CPU time, the top GPU kernels by device time (Triton
kernels included), kernel launches and device syncs per step, and the GPU time per step.
Then the decode forward alone, as CUDA graphs capture it (the fixed-shape step of
`rlsys.model.decode_layout`, run eagerly under the profiler): GPU kernels per forward and
per block, by kernel, and its GPU time; and the step's host share (wall time of a step
minus the GPU time of its kernels, over the step's wall time).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlsys.config.engine import EngineConfig  # noqa: E402
from rlsys.config.model import preset  # noqa: E402
from rlsys.config.sampling import SamplingConfig  # noqa: E402
from rlsys.engine.api import GenerationRequest  # noqa: E402
from rlsys.engine.core import EngineCore  # noqa: E402
from rlsys.engine.runners import make_runner  # noqa: E402
from rlsys.model import RoutingRecorder, Transformer  # noqa: E402
from rlsys.model.decode_layout import StaticDecodeLayout  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--graphs", action="store_true", help="decode steps as CUDA graphs")
    parser.add_argument("--preset", default="medium")
    parser.add_argument("--context", type=int, default=1024, help="prompt tokens")
    args = parser.parse_args()
    torch.manual_seed(0)
    cfg = preset(args.preset).with_overrides({"compute_dtype": "bfloat16"})
    model = Transformer(cfg).cuda().eval()
    ecfg = EngineConfig(
        max_running=args.batch, max_context_tokens=args.context + 1024, device="cuda",
        prefix_cache_tokens=0,
        max_step_tokens=max(args.batch, 8192), cuda_graphs=args.graphs,
    )  # fmt: skip
    core = EngineCore(model.cfg, ecfg, make_runner(model.cfg, ecfg, model.state_dict()))
    params = SamplingConfig(max_tokens_per_turn=64)
    for i in range(args.batch):
        prompt = torch.randint(32, 127, (args.context,)).tolist()
        core.add(GenerationRequest(f"r{i}", f"s{i}", prompt, params, seed=0))
    # prefill every prompt, then warm-up decode steps (compiles everything): the profiled
    # steps are decode-only (with a small step budget, batch x 1024 prompt tokens would
    # still be prefilling)
    while any(s.num_generated == 0 for s in core.running) or core.waiting:
        core.step()
    for _ in range(3):
        core.step()
    torch.cuda.synchronize()
    started = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            core.step()
        torch.cuda.synchronize()
    wall_s = time.perf_counter() - started
    events = prof.key_averages()
    print(events.table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=60))
    print(events.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=60))
    gpu_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA")
    print(f"GPU time per decode step (kernels): {gpu_us / args.steps / 1000:.2f} ms")
    launches = sum(
        e.count
        for e in events
        if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx")
    )
    syncs = sum(
        e.count
        for e in events
        if "Synchronize" in e.key or e.key == "aten::item" or e.key == "aten::_local_scalar_dense"
    )
    print(
        f"per decode step: {launches / args.steps:.0f} kernel launches, {syncs / args.steps:.0f} host syncs"
    )
    print(
        f"step wall {1000 * wall_s / args.steps:.2f} ms (under the profiler), host share "
        f"{max(0.0, 1 - gpu_us / 1e6 / wall_s):.0%} (wall minus kernel time, over wall)"
    )
    kernels_by_grid(prof, args.steps)
    forward_kernels(core, cfg.n_layers)


def kernels_by_grid(prof: profile, steps: int) -> None:
    """The profiled steps' kernels by (name, grid): one kernel name covers several products
    (the Triton linear runs every tree product), and its grid tells them apart; CUPTI
    reports the kernels a replayed CUDA graph runs with their grids too."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    count: Counter[tuple[str, str]] = Counter()
    us: Counter[tuple[str, str]] = Counter()
    for ev in trace.get("traceEvents", []):
        if ev.get("cat") != "kernel":
            continue
        key = (ev["name"][:48], "x".join(str(v) for v in ev.get("args", {}).get("grid", [])))
        count[key] += 1
        us[key] += float(ev.get("dur", 0.0))
    print("\nkernels of a graph-replayed step by grid (per step)")
    print("| launches | GPU us | us per launch | grid | kernel |\n|---:|---:|---:|---|---|")
    for key, total in us.most_common(30):
        print(
            f"| {count[key] / steps:.0f} | {total / steps:.0f} | {total / count[key]:.1f} "
            f"| {key[1]} | `{key[0]}` |"
        )


def forward_kernels(core: EngineCore, n_layers: int) -> None:
    """GPU kernels of one decode forward as graphs capture it, per block and by name."""
    runner = core.runner
    graphs = getattr(runner, "graphs", None)
    caches = [runner.table.caches[s.cache_key] for s in core.running]  # type: ignore[attr-defined]
    if graphs is None or not caches:
        return
    batch = next(b for b in graphs.ladder if b >= len(caches))
    bucket = next(b for b in graphs.buckets if max(c.length for c in caches) < b)
    layout = StaticDecodeLayout(graphs.model.cfg, graphs.pool, batch, bucket - 1, graphs.scratch)
    # the next token's slots (rewritten by the next step); distinct tokens, so the MoE
    # layers route the rows as a real batch does (one token for every row sent them all to
    # the same k experts, and the grouped products read k experts' weights instead of all)
    tokens = torch.randint(32, 127, (len(caches),), generator=torch.Generator().manual_seed(1))
    layout.fill(tokens.tolist(), caches)
    model = graphs.model
    with torch.inference_mode():
        model.forward_decode(layout.tokens, layout.positions, layout.kv, RoutingRecorder())
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            model.forward_decode(layout.tokens, layout.positions, layout.kv, RoutingRecorder())
            torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    by_name = Counter(e.name[:70] for e in kernels)
    us_by_name: Counter[str] = Counter()
    for e in kernels:
        us_by_name[e.name[:70]] += e.device_time
    gpu_ms = sum(e.device_time for e in kernels) / 1000
    print(
        f"decode forward (batch {batch}, bucket {bucket}): {len(kernels)} GPU kernels, "
        f"{len(kernels) / n_layers:.1f} per block, {gpu_ms:.2f} ms of kernel time"
    )
    print("| kernels | GPU ms | us per launch | kernel |\n|---:|---:|---:|---|")
    for name, us in us_by_name.most_common(30):
        n = by_name[name]
        print(f"| {n} | {us / 1000:.3f} | {us / n:.1f} | `{name}` |")


if __name__ == "__main__":
    main()
