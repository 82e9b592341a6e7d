"""Tile configurations of the fp32 router product (the MoE's x @ router.T), on the GPU.

Usage: python benchmarks/bench_router_product.py [--shapes 32x1024,16x512,64x2048]
       [--rows 1,64,256,16384] [--offline]

The router's weight is fp32, so its invariant product runs on `tl.dot` in exact fp32 (FMA,
no tensor cores): at decode sizes it is `partial_products`' split schedule (one program per
(row tile, column tile, K chunk)), consumed by the routing kernel; at training sizes the
serial schedule. A configuration may depend on the weight shape only (it is then the same
for the engine and the trainer, so a change of bits is shared by both), so for each shape
its table ends with the configuration with the lowest decode time, which is what
`linear.FP32_TILES` should hold. "bits" says whether a configuration's product equals the
default configuration's bitwise (informational: any shape-only choice keeps engine and
trainer equal). Each time is one launch's share of a CUDA graph of `--launches` launches
(the median of 5 replays).

`--offline` (no GPU: `kernels/triton_ops/offline.py`) compiles each configuration's split
program for sm_90 instead and prints its registers, spilled stack, SASS instructions, FMAs,
and the programs a launch runs at each decode row count: a screen before device time.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_linear_schedules import graph_us  # noqa: E402
from rlsys.kernels.triton_ops import linear as lin  # noqa: E402
from rlsys.kernels.triton_ops.offline import compile_resources, compile_sass  # noqa: E402
from rlsys.kernels.triton_ops.partials import partial_products  # noqa: E402

CONFIGS = [
    lin.TileConfig(bn=bn, bk=64, warps=warps, stages=stages, bm=bm)
    for bm, bn, warps, stages in [
        (64, 64, 4, 3), (64, 32, 4, 3), (64, 32, 8, 3), (64, 32, 2, 3), (32, 32, 4, 3),
        (32, 32, 2, 3), (16, 32, 2, 3), (16, 32, 1, 3), (16, 32, 4, 3), (16, 16, 1, 3),
        (32, 32, 4, 2), (16, 32, 2, 2),
    ]
]  # fmt: skip


def sweep(n: int, k: int, rows: list[int], launches: int) -> None:
    """One shape's table: every configuration's time per launch at each row count."""
    nch = lin.column_chunks(k)
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
    xs = {m: torch.randn(m, k, device="cuda", generator=gen).bfloat16() for m in rows}
    print(f"\nfp32 weight N={n} K={k}, x bf16, {nch} K chunks")
    print("| bm | bn | warps | stages | " + " | ".join(f"M={m} us" for m in rows) + " | bits |")
    print("|---:|---:|---:|---:|" + "---:|" * len(rows) + "---|")
    ref = {m: partial_products(xs[m], w, nch, cfg=CONFIGS[0]).reduced() for m in rows}
    best = None
    for cfg in CONFIGS:
        cells, same = [], True
        for m in rows:
            out = partial_products(xs[m], w, nch, cfg=cfg).reduced()
            same &= bool(torch.equal(out, ref[m]))
            cells.append(
                graph_us(lambda m=m, cfg=cfg: partial_products(xs[m], w, nch, cfg=cfg), launches, 5)
            )
        decode = sum(us for m, us in zip(rows, cells, strict=True) if m <= 256)
        if best is None or decode < best[0]:
            best = (decode, cfg)
        print(
            f"| {cfg.bm} | {cfg.bn} | {cfg.warps} | {cfg.stages} | "
            + " | ".join(f"{us:.1f}" for us in cells)
            + f" | {'same' if same else 'differ'} |",
            flush=True,
        )
    assert best is not None
    print(f"lowest decode time (rows <= 256): {best[1]} ({best[0]:.1f} us summed)")
    c = best[1]
    print(f"best {n}x{k}: {c.bm} {c.bn} {c.warps} {c.stages}")


def offline(n: int, k: int, rows: list[int]) -> None:
    """One shape's configurations compiled for sm_90 (the split schedule's program, as the
    decode launch specialises it: fp32 weight, bf16 rows, exact `tl.dot`)."""
    nch = lin.column_chunks(k)
    decode = [m for m in rows if m <= 256]
    print(f"\nfp32 weight N={n} K={k}, {nch} K chunks, sm_90 (offline)")
    print(
        "| bm | bn | warps | stages | registers | stack B | SASS | FFMA | FFMA per thread | "
        + " | ".join(f"programs at M={m}" for m in decode)
        + " |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(decode))
    types = {"X": "*bf16", "W": "*fp32", "W3": "*fp32", "Y": "*fp32", "P": "*fp32"}
    types.update(dict.fromkeys(("tile_expert", "tile_row0", "tile_rows"), "*i32"))
    for cfg in CONFIGS:
        bk = lin.chunk_step(k // nch, cfg.bk)
        consts = {
            "NCH": nch, "GROUPED": False, "SWIGLU": False, "SPLIT": True, "BM": cfg.bm,
            "BN": cfg.bn, "BK": bk, "EVEN": (k // nch) % bk == 0, "UPCAST": False,
            "PRECISION": "ieee", "sx_k": 1, "sw_k": 1, "sy_n": 1,  # unit strides, as launched
        }  # fmt: skip
        opts = {"num_warps": cfg.warps, "num_stages": cfg.stages}
        args = (f"{lin.__name__}:_matmul", types, consts, opts)
        aligned = ("K", "MN", "sx_m", "sw_n")
        res = compile_resources(*args, divisible=aligned)
        sass = compile_sass(*args, divisible=aligned)
        code = re.findall(r"/\*[0-9a-f]{4,}\*/\s+([A-Z][A-Z0-9_.]*)", sass)
        ffma = sum(op.startswith("FFMA") for op in code)
        programs = [-(-m // cfg.bm) * -(-n // cfg.bn) * nch for m in decode]
        print(
            f"| {cfg.bm} | {cfg.bn} | {cfg.warps} | {cfg.stages} | {res.registers} | {res.stack} "
            f"| {len(code)} | {ffma} | {cfg.bm * cfg.bn * bk // (32 * cfg.warps)} | "
            + " | ".join(str(p) for p in programs)
            + " |",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="32x1024,16x512,64x2048", help="N x K, fp32 weights")
    parser.add_argument("--rows", default="1,64,256,16384")
    parser.add_argument("--launches", type=int, default=40)
    parser.add_argument("--offline", action="store_true", help="compile for sm_90, no GPU")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    if not args.offline:
        print(torch.cuda.get_device_name())
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        if args.offline:
            offline(n, k, rows)
        else:
            sweep(n, k, rows, args.launches)


if __name__ == "__main__":
    main()
