"""Sweep the batch-invariant linear's tile configurations on the GPU, against cuBLAS.

Usage: python benchmarks/bench_linear_tiles.py [--shapes 2048x2048,4096x2048] [--rows 1,64,4096,16384]
A configuration may depend on the weight shape (N, K) only, so for each shape the table
ends with the configuration with the lowest total time over all row counts, which is what
`rlsys.kernels.triton_ops.linear.TILES` should hold.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_attention import timed  # noqa: E402
from rlsys.kernels.triton_ops.linear import TileConfig, linear_fwd  # noqa: E402

CONFIGS = [
    TileConfig(bn, bk, warps, stages)
    for bn, bk, warps, stages in [
        (64, 64, 4, 3), (64, 64, 4, 4), (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3),
        (32, 128, 4, 4), (64, 128, 4, 3), (256, 64, 8, 3), (16, 256, 4, 3),
    ]
]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="2048x2048,6144x2048,2048x768,320x512,1536x512")
    parser.add_argument("--rows", default="1,64,512,4096,16384")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        xs = {m: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for m in rows}
        blas = {m: timed(lambda m=m: F.linear(xs[m], w), args.reps) for m in rows}
        print(f"\nN={n} K={k} | " + " | ".join(f"M={m}" for m in rows) + " | sum / cuBLAS sum")
        print("|---|" + "---:|" * (len(rows) + 1))
        print("| cuBLAS | " + " | ".join(f"{blas[m] * 1000:.0f} us" for m in rows) + " | 1.00 |")
        best = None
        for cfg in CONFIGS:
            try:
                t = {m: timed(lambda m=m: linear_fwd(xs[m], w, cfg=cfg), args.reps) for m in rows}
            except Exception as err:  # a config the compiler rejects is skipped, and said so
                print(f"| {cfg} | failed: {type(err).__name__} |")
                continue
            ratio = sum(t.values()) / sum(blas.values())
            cells = " | ".join(f"{t[m] * 1000:.0f} us ({t[m] / blas[m]:.2f}x)" for m in rows)
            print(
                f"| bn{cfg.bn} bk{cfg.bk} w{cfg.warps} s{cfg.stages} | {cells} | {ratio:.2f} |",
                flush=True,
            )
            if best is None or ratio < best[0]:
                best = (ratio, cfg)
        print(f"best for ({n}, {k}): {best}")


if __name__ == "__main__":
    main()
