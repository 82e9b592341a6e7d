"""The batch-invariant linear's schedules against cuBLAS, as a decode step sees them.

Usage: python benchmarks/bench_linear_schedules.py [--shapes 1024x1024,...] [--rows 1,64,4096]

Each call is timed inside a CUDA graph of `--calls` back-to-back calls (the engine replays
decode steps as graphs), so the figure is GPU time per call without Python's launch cost.
Columns: cuBLAS (`F.linear`, free to pick any algorithm per shape), the invariant product
with its chunks in one program (`serial`), one program per (tile, chunk) plus the tree
kernel (`split`), and what the engine runs (`auto`); the tax is auto over cuBLAS, and HBM
is the bytes a call must move (weight, input, output) over its time, against 4.8 TB/s.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.device_peaks import describe, device_peak  # noqa: E402
from rlsys.kernels.triton_ops.linear import column_chunks, linear_fwd  # noqa: E402

# medium: q/o 512x512, k/v 128x512, expert 256x512; large: 1024x1024, 256x1024, 512x1024;
# both LM heads (320 byte-level tokens)
DEFAULT_SHAPES = "512x512,128x512,1024x1024,256x1024,512x1024,320x1024"


def graph_us(fn: Callable[[], object], calls: int, reps: int) -> float:
    """Median microseconds per call of `fn`, replayed as a graph of `calls` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="NxK weights, comma-separated")
    parser.add_argument("--rows", default="1,16,64,256,4096")
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    print(f"device: {torch.cuda.get_device_name()}, bf16, per call in a CUDA graph")
    print(describe(device_peak()))
    print(
        "\n| weight N x K | tree | rows | cuBLAS us | serial us | split us | auto us | tax | auto HBM |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    totals = {"blas": 0.0, "serial": 0.0, "auto": 0.0}
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t = {
                "blas": graph_us(lambda: F.linear(x, w), args.calls, args.reps),
                "serial": graph_us(
                    lambda: linear_fwd(x, w, schedule="serial"), args.calls, args.reps
                ),
                "split": graph_us(
                    lambda: linear_fwd(x, w, schedule="split"), args.calls, args.reps
                ),
                "auto": graph_us(lambda: linear_fwd(x, w), args.calls, args.reps),
            }
            for key in totals:
                totals[key] += t[key]
            moved = 2 * (n * k + m * k + m * n)
            hbm = moved / (t["auto"] * 1e-6) / device_peak().hbm_bytes_per_s
            print(
                f"| {n} x {k} | {column_chunks(k)} | {m} | {t['blas']:.1f} | {t['serial']:.1f} "
                f"| {t['split']:.1f} | {t['auto']:.1f} | {t['auto'] / t['blas'] - 1:+.0%} "
                f"| {hbm:.1%} |",
                flush=True,
            )
    print(
        f"\nsum over the table: cuBLAS {totals['blas']:.0f} us, serial {totals['serial']:.0f} us "
        f"({totals['serial'] / totals['blas']:.2f}x), auto {totals['auto']:.0f} us "
        f"({totals['auto'] / totals['blas']:.2f}x)"
    )


if __name__ == "__main__":
    main()
