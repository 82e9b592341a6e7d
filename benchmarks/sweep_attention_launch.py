"""The attention kernels' geometry and launch options, swept at the `large` layer shape.

Usage (GPU machine, repository root):
    python benchmarks/sweep_attention_launch.py [--length 32768] [--tiles 16,32]
    python benchmarks/sweep_attention_launch.py --smoke     # tiny shapes (interpreter)

For each query tile T (slots per program; the model's is `KernelGeometry.query_tile`) it
times, on one sequence (16 query heads, 4 KV groups, head dim 128, bf16; Sparse GQA B=8,
k=4096 over the clustered selection of `bench_attention.py`; SWA window 512):
- the forward (Sparse GQA and SWA prefill, and a Sparse GQA / SWA decode step of `batch`
  sequences at `context`) under each (warps, stages) of the forward;
- the backward (dq with dK/dV at their defaults and the other way round) under each
  (warps, stages) of the kernel being swept;
- the indexer KL's block mass under each (warps, stages).
The forward's options are shared by engine and trainer (its bits follow the program's
layout), so a change there is a change of the model's numerics for both; the backward's
and the block mass's options change no value. Prints one markdown table.

A prefill row's note also says whether its outputs (Sparse GQA and SWA) equal, bit for
bit, those of the first configuration swept (first tile, first launch options): whether a
row's bits depend on the tile and the warps its program has. `--scale-warps` gives a wider
tile warps in proportion (16 rows per warp at any tile): on an H100 a 32-slot tile on 8 warps
kept every bit but ran slower (BENCHMARKS, the prefill tile).
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_attention import index_inputs, timed  # noqa: E402
from rlsys.kernels.attention_plan import PagedKV, Span, contiguous_table, plan_tiles  # noqa: E402
from rlsys.kernels.triton_ops import attention_bwd, attention_fwd  # noqa: E402
from rlsys.kernels.triton_ops.indexer import select_blocks, union_steps  # noqa: E402

H, HKV, B, W = 16, 4, 8, 512
D = 128  # `--head-dim` sets it
PAGE, SPARSE_STEP, SWA_STEP = 64, 16, 32


def configs(warps: str, stages: str) -> list[dict[str, int]]:
    return [
        {"num_warps": int(w), "num_stages": int(s)}
        for w, s in itertools.product(warps.split(","), stages.split(","))
    ]


SCALE_WARPS = False  # `--scale-warps`


def scaled(cfg: dict[str, int], t: int) -> dict[str, int]:
    """`cfg` for a tile of t slots: under `--scale-warps` its warps (given per 64 tile rows)
    times the tile's rows / 64, so every warp holds 16 rows at any tile."""
    if not SCALE_WARPS:
        return cfg
    return {**cfg, "num_warps": cfg["num_warps"] * max(1, t * (H // HKV) // 64)}


@contextmanager
def launching(module: ModuleType, name: str, cfg: dict[str, int]) -> Iterator[None]:
    """The module's launch constant `name` set to `cfg` inside; its own value restored after."""
    own = getattr(module, name)
    setattr(module, name, cfg)
    try:
        yield
    finally:
        setattr(module, name, own)


def row(
    t: int, kernel: str, cfg: dict[str, int], sparse_ms: float, swa_ms: float, note: str
) -> None:
    """One table row; the warps are those launched (`--scale-warps`: the swept warps,
    given per 64 tile rows, times the tile's rows / 64)."""
    cfg = scaled(cfg, t)
    print(
        f"| {t} | {kernel} | {cfg['num_warps']} | {cfg['num_stages']} | {sparse_ms:.2f} "
        f"| {swa_ms:.2f} | {note} |",
        flush=True,
    )


def sweep_tile(t: int, args: argparse.Namespace, dev: str, first_tile: dict) -> None:
    length, ksel = args.length, args.topk // B
    gen = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dev, torch.bfloat16)

    q, k, v = randn(length, H, D), randn(length, HKV, D), randn(length, HKV, D)
    qi, bk = index_inputs(length, dev, random_sel=False)
    kv = contiguous_table([length], PAGE, dev)
    bkt = PagedKV(kv.block_table // B, PAGE // B)
    tiles = plan_tiles([Span(0, 0, length, 0)], t, dev)
    sel = select_blocks(qi, bk, tiles, bkt, topk_blocks=ksel, block=B, precision="tf32")
    off, ids = union_steps(sel, tiles, block=B, step=SPARSE_STEP)
    union = float((off[1:] - off[:-1]).float().mean()) * SPARSE_STEP / args.topk
    scale = 1 / math.sqrt(D)
    sparse = {"scale": scale, "step": SPARSE_STEP, "sparse": (off, ids, sel.bits), "block": B}
    swa = {"scale": scale, "step": SWA_STEP, "window": W}
    dec = decode_inputs(t, args, dev)
    first_out: torch.Tensor | None = None
    for cfg in configs(args.warps, args.fwd_stages):
        try:
            with launching(attention_fwd, "FORWARD_LAUNCH", scaled(cfg, t)):
                out_sp, _ = attention_fwd.attention_forward(q, k, v, tiles, kv, **sparse)
                if first_out is None:
                    first_out, bits = out_sp, "base"
                else:
                    bits = "same bits" if torch.equal(out_sp, first_out) else "other bits"
                out_sw, _ = attention_fwd.attention_forward(q, k, v, tiles, kv, **swa)
                bits += across_tiles(first_tile, cfg, t, (out_sp, out_sw))
                sp_ms = timed(
                    lambda: attention_fwd.attention_forward(q, k, v, tiles, kv, **sparse), args.reps
                )
                sw_ms = timed(
                    lambda: attention_fwd.attention_forward(q, k, v, tiles, kv, **swa), args.reps
                )
                row(t, "forward prefill", cfg, sp_ms, sw_ms, f"union/k {union:.2f}; {bits}")
                dsp = timed(dec["sparse"], args.reps)
                dsw = timed(dec["swa"], args.reps)
                row(t, f"forward decode {args.batch}x{args.context}", cfg, dsp, dsw, "")
        except Exception as exc:  # a configuration out of resources must not hide the rest
            row(t, "forward", cfg, float("nan"), float("nan"), type(exc).__name__)
    out_sp, lse_sp = attention_fwd.attention_forward(q, k, v, tiles, kv, **sparse)
    out_sw, lse_sw = attention_fwd.attention_forward(q, k, v, tiles, kv, **swa)
    do = randn(length, H, D)

    def backward(out: torch.Tensor, lse: torch.Tensor, shape: dict) -> object:
        return attention_bwd.attention_backward(do, q, k, v, out, lse, tiles, kv, [length], **shape)

    def mass() -> object:
        return attention_bwd.block_mass(
            q, k, lse_sp, tiles, kv, sparse["sparse"], ksel, scale=scale, step=SPARSE_STEP, block=B
        )

    sweeps = [
        ("backward (dq swept)", "DQ_LAUNCH", args.warps, lambda: backward(out_sp, lse_sp, sparse),
         lambda: backward(out_sw, lse_sw, swa)),
        ("backward (dkv swept)", "DKV_LAUNCH", args.warps, lambda: backward(out_sp, lse_sp, sparse),
         lambda: backward(out_sw, lse_sw, swa)),
        ("block mass", "MASS_LAUNCH", args.mass_warps, mass, None),
    ]  # fmt: skip
    for kernel, name, warps, sparse_call, swa_call in sweeps:
        for cfg in configs(warps, args.stages):
            try:
                with launching(attention_bwd, name, scaled(cfg, t)):
                    sp_ms = timed(sparse_call, args.reps)
                    sw_ms = timed(swa_call, args.reps) if swa_call else float("nan")
                row(t, kernel, cfg, sp_ms, sw_ms, "")
            except Exception as exc:  # out of resources: the other rows still print
                row(t, kernel, cfg, float("nan"), float("nan"), type(exc).__name__)


def across_tiles(first: dict, cfg: dict[str, int], t: int, outs: tuple) -> str:
    """'' for the first configuration swept; else whether Sparse GQA's and SWA's prefill
    outputs equal its outputs (the first tile's, first launch options), bit for bit."""
    if not first:
        first.update(tile=t, launch=cfg, outs=outs)
        return ""
    ref = first["outs"]
    same = ["same" if torch.equal(a, b) else "OTHER" for a, b in zip(outs, ref, strict=True)]
    w = first["launch"]["num_warps"]
    return f"; vs T={first['tile']} {w} warps: Sparse {same[0]}, SWA {same[1]}"


def decode_inputs(t: int, args: argparse.Namespace, dev: str) -> dict:
    """One decode step's attention (Sparse GQA with its selection, and SWA) as closures."""
    batch, ctx, ksel = args.batch, args.context, args.topk // B
    pages = ctx // PAGE
    k = torch.randn(batch * ctx, HKV, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    perm = torch.randperm(batch * pages, device=dev).view(batch, pages).to(torch.int32)
    kv = PagedKV(perm * PAGE, PAGE)
    bkt = PagedKV(perm * (PAGE // B), PAGE // B)
    bk = torch.randn(batch * ctx // B, 64, device=dev)
    qi = torch.randn(batch, HKV, 64, device=dev)
    q = torch.randn(batch, H, D, device=dev, dtype=torch.bfloat16)
    tiles = plan_tiles([Span(s, s, 1, ctx - 1) for s in range(batch)], t, dev)
    sel = select_blocks(qi, bk, tiles, bkt, topk_blocks=ksel, block=B, precision="tf32")
    off, ids = union_steps(sel, tiles, block=B, step=SPARSE_STEP)
    scale = 1 / math.sqrt(D)
    return {
        "sparse": lambda: attention_fwd.attention_forward(
            q, k, v, tiles, kv, scale=scale, step=SPARSE_STEP, sparse=(off, ids, sel.bits), block=B
        ),
        "swa": lambda: attention_fwd.attention_forward(
            q, k, v, tiles, kv, scale=scale, step=SWA_STEP, window=W
        ),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--length", type=int, default=32768)
    p.add_argument("--tiles", default="16,32")
    p.add_argument("--warps", default="4,8", help="forward and backward warps (comma list)")
    p.add_argument(
        "--scale-warps", action="store_true", help="--warps per 64 tile rows (16 rows per warp)"
    )
    p.add_argument("--mass-warps", default="2,4")
    p.add_argument("--fwd-stages", default="2,3")
    p.add_argument("--stages", default="3", help="stages of the backward and block mass")
    p.add_argument("--topk", type=int, default=4096)
    p.add_argument("--batch", type=int, default=64, help="decode batch")
    p.add_argument("--context", type=int, default=32768, help="decode context")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter)")
    args = p.parse_args()
    global D, SCALE_WARPS
    D, SCALE_WARPS = args.head_dim, args.scale_warps
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        args.length, args.topk, args.batch, args.context, args.reps = 256, 64, 2, 256, 1
        args.warps, args.fwd_stages, args.stages, args.mass_warps = "4", "3", "3", "2"
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    print(
        f"device: {name}; torch {torch.__version__}; one sequence of {args.length} tokens; "
        f"head dim {D}"
    )
    print("\n| T | kernel | warps | stages | Sparse GQA ms | SWA ms | note |")
    print("|---:|---|---:|---:|---:|---:|---|")
    first_tile: dict = {}
    for t in (int(x) for x in args.tiles.split(",")):
        sweep_tile(t, args, dev, first_tile)


if __name__ == "__main__":
    main()
