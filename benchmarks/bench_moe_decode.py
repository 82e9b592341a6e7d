"""The routed experts' products at decode sizes on the GPU, each call timed in a CUDA graph.

Usage (GPU machine): python benchmarks/bench_moe_decode.py [--preset large] [--batches 16,64,256]

A batch of tokens is routed uniformly at random (top-k of E, as a trained router spreads
them), laid out as the engine's fused MoE path lays them out (`moe_route.expert_layout`),
and each product is replayed as a graph of `--calls` back-to-back calls:
- w13: the grouped GEMM over every expert's [w1; w3] (what the invariant mode runs), and the
  Triton grouped SwiGLU at each tile configuration;
- w2: the Triton grouped tree's chunk products (what the engine hands the combine) at each
  tile configuration, and the plain grouped GEMM (no tree: the ceiling).
HBM is the bytes a call must move (the touched experts' weights, the rows in and out)
over its time, against 4.8 TB/s. A tile configuration is a function of the weight shape
only, so a row here says what `linear.TILES` should hold for that shape.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_linear_schedules import graph_us  # noqa: E402
from benchmarks.device_peaks import describe, device_peak  # noqa: E402
from rlsys.config.model import preset  # noqa: E402
from rlsys.kernels.triton_ops import linear as lin  # noqa: E402
from rlsys.kernels.triton_ops import moe_route as mr  # noqa: E402
from rlsys.kernels.triton_ops.grouped_decode import (  # noqa: E402
    grouped_swiglu_rows,
    grouped_tree_rows,
)
from rlsys.kernels.triton_ops.partials import partial_products  # noqa: E402
from rlsys.kernels.triton_ops.products import cublas_grouped_swiglu, grouped_mm  # noqa: E402

CONFIGS = [
    lin.TileConfig(bn, bk, warps, stages)
    for bn, bk, warps, stages in [
        (64, 64, 4, 3), (32, 64, 4, 4), (128, 64, 4, 3), (128, 64, 4, 4), (128, 64, 8, 4),
        (256, 64, 8, 3), (64, 64, 4, 5), (64, 32, 4, 6), (128, 32, 4, 6),
    ]
]  # fmt: skip


def hbm(moved: int, us: float) -> str:
    return f"{moved / (us * 1e-6) / device_peak().hbm_bytes_per_s:.0%}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="large")
    parser.add_argument("--batches", default="16,64,256")
    parser.add_argument("--calls", type=int, default=48)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--chunks", type=int, default=8, help="the down projection's tree width")
    args = parser.parse_args()
    cfg = preset(args.preset)
    e, h, d, k = cfg.n_experts, cfg.expert_hidden, cfg.d_model, cfg.experts_per_token
    dev, dt = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    w1 = torch.randn(e, h, d, device=dev, generator=gen).to(dt) * 0.02
    w3 = torch.randn(e, h, d, device=dev, generator=gen).to(dt) * 0.02
    w2 = torch.randn(e, d, h, device=dev, generator=gen).to(dt) * 0.02
    w13s = torch.cat([w1, w3], dim=1)
    w13t = w13s.transpose(1, 2)
    w2t = w2.transpose(1, 2)
    print(f"device: {torch.cuda.get_device_name()}, {args.preset}: E={e} k={k} H={h} d={d}, bf16")
    print(describe(device_peak()))
    print("\n| tokens | rows | experts touched | product | implementation | us | HBM |")
    print("|---:|---:|---:|---|---|---:|---:|")
    for n in (int(b) for b in args.batches.split(",")):
        idx = torch.stack([torch.randperm(e, device=dev, generator=gen)[:k] for _ in range(n)])
        touched = int(idx.unique().numel())
        max_tiles = -(-idx.numel() // lin.BM) + e
        _pos, order, offsets, tiles = mr.expert_layout(idx, e, max_tiles, lin.BM)
        x = torch.randn(n, d, device=dev, generator=gen).to(dt)
        xs = mr.gather_rows(x, order, k)
        hid = torch.randn(n * k, h, device=dev, generator=gen).to(dt)
        rows = n * k
        w13_bytes = touched * 2 * h * d * 2 + rows * (d + h) * 2
        w2_bytes = touched * d * h * 2 + rows * (h * 2 + d * 4)
        head = f"| {n} | {rows} | {touched} |"

        def row(product: str, impl: str, us: float, moved: int) -> None:
            print(f"{head} {product} | {impl} | {us:.1f} | {hbm(moved, us)} |", flush=True)

        us = graph_us(lambda: grouped_mm(xs, w13t, offsets), args.calls, args.reps)
        row("w13", "grouped GEMM (invariant mode)", us, w13_bytes)
        us = graph_us(
            lambda: cublas_grouped_swiglu(xs, w1, w3, offsets, w13s), args.calls, args.reps
        )
        row("w13", "grouped GEMM + silu_mul (invariant mode)", us, w13_bytes)
        same = torch.equal(
            grouped_swiglu_rows(xs, w13s, offsets), cublas_grouped_swiglu(xs, w1, w3, offsets, w13s)
        )
        us = graph_us(lambda: grouped_swiglu_rows(xs, w13s, offsets), args.calls, args.reps)
        row("w13", f"decode kernel, SwiGLU fused (bitwise the above: {same})", us, w13_bytes)
        us = graph_us(
            lambda: grouped_swiglu_rows(x, w13s, offsets, order, k), args.calls, args.reps
        )
        row("w13", "decode kernel reading the tokens through the routing order", us, w13_bytes)
        us = graph_us(lambda: mr.gather_rows(x, order, k), args.calls, args.reps)
        row("w13", "(the gather it saves: `gather_rows` alone)", us, rows * d * 4)
        for c in CONFIGS:
            lin.TILES[(h, d)] = c
            try:
                us = graph_us(lambda: lin.swiglu_fwd(xs, w1, w3, tiles), args.calls, args.reps)
                row("w13", f"Triton {c.bn}x{c.bk} w{c.warps} s{c.stages}", us, w13_bytes)
            except Exception as err:  # noqa: BLE001 (a configuration the GPU cannot run)
                row("w13", f"Triton {c.bn}x{c.bk} w{c.warps} s{c.stages}: {type(err).__name__}",
                    float("nan"), w13_bytes)  # fmt: skip
        lin.TILES.pop((h, d), None)
        us = graph_us(lambda: grouped_mm(hid, w2t, offsets), args.calls, args.reps)
        row("w2", "grouped GEMM (plain, no tree)", us, w2_bytes)
        tree = lin.grouped_tree_fwd(hid, w2, tiles, args.chunks)
        same = torch.equal(grouped_tree_rows(hid, w2, offsets, args.chunks), tree)
        us = graph_us(
            lambda: grouped_tree_rows(hid, w2, offsets, args.chunks), args.calls, args.reps
        )
        row("w2", f"decode kernel (bitwise the Triton tree: {same})", us, w2_bytes)
        for c in CONFIGS:
            lin.TILES[(d, h)] = c
            try:
                us = graph_us(
                    lambda: partial_products(hid, w2, args.chunks, tiles), args.calls, args.reps
                )
                row("w2", f"Triton partials {c.bn}x{c.bk} w{c.warps} s{c.stages}", us, w2_bytes)
            except Exception as err:  # noqa: BLE001
                row("w2", f"Triton {c.bn}x{c.bk} w{c.warps} s{c.stages}: {type(err).__name__}",
                    float("nan"), w2_bytes)  # fmt: skip
        lin.TILES.pop((d, h), None)


if __name__ == "__main__":
    main()
