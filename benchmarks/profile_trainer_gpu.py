"""Where a trainer step's time goes on the GPU (torch profiler): top kernels and host ops.

Usage (GPU machine): python benchmarks/profile_trainer_gpu.py [--preset large] [--layers 8]
    [--length 8192] [--graphs]
The preset is cut to `--layers` blocks (same 3:1 pattern) so the profile is quick; one
warm-up `train_step` on two sequences of `--length` tokens (replay on, chunked LM head),
then one profiled step: wall time, GPU kernel time and its share of the wall (GPU busy), the
top ops by device and host time, and per step the kernel launches and `aten` op calls (all,
and the most frequent). `--syncs` then runs one more step under CUDA's sync debug mode and
prints each place in the project that made the host wait for the device (a wait drains the
device's queue: it idles until the host has launched the next kernels), with its count.
`--sites N` profiles one more (eager) step with Python stacks and prints the N project
lines whose kernels take the most GPU time (kernels of built-in backward nodes are charged to
the node): where a fusion saves the most device time. `--rows N` widens the kernel table.
`--graphs` turns on `trainer.cuda_graphs`: what is left of the host's share then. Without
it the script uses only APIs main has had since the trainer existed, so the same script
measures an older tree (copy it over) for a before/after.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_trainer_gpu import busy_us, kernel_spans, trajectory  # noqa: E402
from rlsys.config.algo import AlgoConfig  # noqa: E402
from rlsys.config.job import TrainerSection  # noqa: E402
from rlsys.config.model import preset  # noqa: E402
from rlsys.model import Transformer  # noqa: E402
from rlsys.trainer import Trainer  # noqa: E402

# the runtime calls that start a kernel (launch count = their calls)
# the project's source folders, as the profiler names Python calls
PROJECT_DIRS = ("rlsys/", "kernels/")
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")


def profiled_trainer(
    preset_name: str, layers: int, length: int, graphs: bool, device: str = "cuda"
) -> tuple[Trainer, list]:
    """The profiled step's trainer and its two trajectories of `length` tokens (the second
    with reward 0): the preset cut to `layers` blocks (0: all), replay on, chunked LM
    head, one sequence per micro-batch."""
    torch.manual_seed(0)
    cfg = preset(preset_name)
    if layers:
        cfg = cfg.with_overrides({"n_layers": layers})
    model = Transformer(cfg).to(device)
    trajs = [trajectory(model, length, device), trajectory(model, length, device)]
    trajs[1].reward = 0.0
    section = TrainerSection(
        replay_experts="indices", replay_candidates=True, lm_head_chunk=1024,
        micro_batch_tokens=length, mismatch_rollouts=0, cuda_graphs=graphs,
    )  # fmt: skip
    return Trainer(model, section, AlgoConfig(max_staleness=10**6)), trajs


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="large")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--length", type=int, default=8192)
    p.add_argument("--syncs", action="store_true", help="list the step's host waits by place")
    p.add_argument("--graphs", action="store_true", help="the trunk as CUDA graphs (cuda_graphs)")
    p.add_argument("--rows", type=int, default=30, help="rows of the kernel table")
    p.add_argument("--sites", type=int, default=0, help="top project lines by GPU time")
    args = p.parse_args()
    trainer, trajs = profiled_trainer(args.preset, args.layers, args.length, args.graphs)
    trainer.train_step(trajs)
    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        trainer.train_step(trajs)
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    events = prof.key_averages()
    print(
        events.table(
            sort_by="self_device_time_total", row_limit=args.rows, max_name_column_width=90
        )
    )
    print(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=50))
    gpu_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA")
    print(f"{args.preset} cut to {args.layers} blocks, 2 x {args.length} tokens")
    print(
        f"step wall (profiled) {wall:.2f} s; GPU kernel time {gpu_us / 1e6:.2f} s; "
        f"GPU busy {gpu_us / 1e6 / wall:.1%}"
    )
    launches = sum(e.count for e in events if e.key in LAUNCHES)
    kernels = sum(
        e.count
        for e in events
        if e.device_type.name == "CUDA" and not e.key.startswith(("Memcpy", "Memset"))
    )
    aten = {e.key: e.count for e in events if e.key.startswith("aten::")}
    top = sorted(aten.items(), key=lambda kv: -kv[1])[:8]
    print(
        f"per step: {kernels:,} GPU kernels run, {launches:,} launch calls seen by the "
        f"profiler; {sum(aten.values()):,} aten op calls"
    )
    print("most frequent aten ops: " + ", ".join(f"{k[6:]} {v:,}" for k, v in top))
    print_kernel_sizes(prof)
    if args.syncs:
        print_syncs(trainer, trajs)
    if args.sites:
        print_sites(trainer, trajs, args.sites)


SIZE_EDGES_US = (5, 20, 100, 1000)  # kernel durations binned at these edges


def print_kernel_sizes(prof: profile) -> None:
    """The step's kernels binned by duration (count and time per bin), and the device's idle
    time inside the step's kernel span (first kernel start to last kernel end, gaps between
    kernels that overlap nothing). The span is the profiled step's, whose host the
    profiler slows: its idle share overstates the unprofiled step's (`bench_trainer_gpu.py`
    measures busy against the unprofiled wall)."""
    spans = kernel_spans(prof)
    if not spans:
        return
    bins = [[0, 0.0] for _ in range(len(SIZE_EDGES_US) + 1)]
    for start, end in spans:
        slot = sum(end - start >= edge for edge in SIZE_EDGES_US)
        bins[slot][0] += 1
        bins[slot][1] += end - start
    busy = busy_us(spans)
    span = max(end for _, end in spans) - spans[0][0]
    total = sum(b[1] for b in bins)
    print(
        f"kernel span (profiled) {span / 1e3:.1f} ms: device busy {busy / 1e3:.1f} ms ({busy / span:.1%}), "
        f"idle between kernels {(span - busy) / 1e3:.1f} ms"
    )
    labels = [f"< {SIZE_EDGES_US[0]} us"]
    labels += [f"{a}-{b} us" for a, b in zip(SIZE_EDGES_US, SIZE_EDGES_US[1:], strict=False)]
    labels += [f">= {SIZE_EDGES_US[-1]} us"]
    print("| kernel duration | kernels | ms | share of kernel time |\n|---|---:|---:|---:|")
    for label, (n, us) in zip(labels, bins, strict=True):
        print(f"| {label} | {n:,} | {us / 1e3:.1f} | {us / total:.1%} |")


def _site(event: object) -> str:
    """The innermost project function on an op's Python stack, else the built-in backward
    node that ran it. Torch versions differ in where the stack is: a list of frames on the
    event (`path(line): function`), or Python calls recorded as parent events so named."""
    for frame in getattr(event, "stack", None) or []:
        path = frame.split("(", 1)[0]
        for top in PROJECT_DIRS:
            if f"/{top}" in path and "/site-packages/" not in path:
                return top + frame.split(f"/{top}", 1)[1]
    parent = getattr(event, "cpu_parent", None)
    while parent is not None:
        if parent.name.startswith(PROJECT_DIRS):
            return parent.name
        if parent.name.startswith("autograd::engine::evaluate_function: "):
            return "<backward " + parent.name.split(": ", 1)[1] + ">"
        parent = parent.cpu_parent
    return f"<{event.name}>"


def print_sites(trainer: Trainer, trajs: list, top: int) -> None:
    """One more step profiled with Python stacks: GPU time and kernels per project line.
    Each CPU op's self device time (its own kernels, not its children's) is charged once,
    so the rows sum to the step's kernel time."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        trainer.train_step(trajs)
        torch.cuda.synchronize()
    time_us: collections.Counter[str] = collections.Counter()
    kernels: collections.Counter[str] = collections.Counter()
    for event in prof.events():
        if event.device_type.name != "CPU" or event.self_device_time_total <= 0:
            continue
        site = _site(event)
        time_us[site] += event.self_device_time_total
        kernels[site] += len(event.kernels)
    total = sum(time_us.values())
    print(f"GPU time by project line (eager step, {total / 1e3:.1f} ms of kernels)")
    print("| ms | share | kernels | line |\n|---:|---:|---:|---|")
    for site, us in time_us.most_common(top):
        print(f"| {us / 1e3:.2f} | {us / total:.1%} | {kernels[site]} | `{site}` |")


def print_syncs(trainer: Trainer, trajs: list) -> None:
    """One step under sync debug mode: each synchronizing call's innermost project frames."""
    root = str(Path(__file__).resolve().parents[1])
    places: collections.Counter[str] = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001, ARG001
        if "synchronizing" not in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-1] if f.filename.startswith(root)]
        where = " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in frames[::-1][:3])
        places[where or "(outside the project)"] += 1

    shown = warnings.showwarning
    warnings.showwarning = record
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")
    try:
        trainer.train_step(trajs)
        torch.cuda.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = shown
    print(f"host waits in one step: {sum(places.values())}")
    for where, n in places.most_common(20):
        print(f"  {n:5d}  {where}")


if __name__ == "__main__":
    main()
