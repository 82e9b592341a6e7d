"""Sweep the tile configurations of the row-parallel tree products (`linear_tree_fwd`, and
the routed experts' `grouped_tree_fwd`) on the GPU: time, and whether each configuration
gives bitwise the default configuration's output.

Usage (GPU machine): python benchmarks/bench_tree_tiles.py [--preset large] [--tokens 16384]
    [--decode-rows 64] [--reps 20] [--configs bn/bk/warps/stages[/bm],...] [--halved off|on|both]

The trees are the products the dispatcher keeps on the Triton kernels (the attention output
and the experts' down projections: an fp32 tree of 8 K-chunk products). Shapes come from the
preset: the dense tree (d_model x heads * head_dim), the grouped tree (E x d_model x
expert_hidden) over tokens x top-k rows routed uniformly at random. A configuration may depend
on the weight shape only (engine and trainer must reduce alike), so a row's bits must not
change with it either unless every consumer changes with it: the "bits" column says whether
the configuration's output equals the default's bitwise at every row count timed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_attention import timed  # noqa: E402
from rlsys.config.model import preset  # noqa: E402
from rlsys.kernels.triton_ops import linear as lin  # noqa: E402

CONFIGS = [
    lin.TileConfig(bn, bk, warps, stages)
    for bn, bk, warps, stages in [
        (64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (128, 64, 4, 4), (256, 64, 8, 3),
        (128, 64, 8, 4), (64, 64, 4, 4), (256, 64, 4, 3),
    ]
]  # fmt: skip
N_CHUNKS = 8


def _tree(
    x: torch.Tensor, w: torch.Tensor, tiles: tuple | None, cfg: lin.TileConfig
) -> torch.Tensor:
    n = w.shape[-2]
    out = torch.empty(x.shape[0], n, dtype=torch.float32, device=x.device)
    return lin._launch(x, w, None, out, n, N_CHUNKS, tiles, False, cfg=cfg)


def _cases(args: argparse.Namespace) -> list[tuple[str, torch.Tensor, torch.Tensor, tuple | None]]:
    cfg = preset(args.preset)
    dev, bf = "cuda", torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    d, hd, e, hid = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.n_experts, cfg.expert_hidden
    w_o = (torch.randn(d, hd, device=dev, generator=gen) * 0.02).to(bf)
    w2 = (torch.randn(e, d, hid, device=dev, generator=gen) * 0.02).to(bf)
    cases = []
    for rows in (args.tokens, args.decode_rows):
        x = torch.randn(rows, hd, device=dev, generator=gen).to(bf)
        cases.append((f"dense {d}x{hd}, {rows} rows", x, w_o, None))
        routed = rows * cfg.experts_per_token
        expert = torch.randint(0, e, (routed,), device=dev, generator=gen)
        counts = torch.bincount(expert, minlength=e).to(torch.int32)
        tiles = lin.expert_tiles(counts, -(-routed // lin.BM) + e)
        h = torch.randn(routed, hid, device=dev, generator=gen).to(bf)
        cases.append((f"grouped {e}x{d}x{hid}, {routed} rows", h, w2, tiles))
    return cases


def _parse_configs(text: str) -> list[lin.TileConfig]:
    """ "bn/bk/warps/stages[/bm],...": the configurations to time (the first is the reference)."""
    out = []
    for item in text.split(","):
        parts = [int(v) for v in item.split("/")]
        if len(parts) not in (4, 5):
            raise SystemExit(f"--configs item {item!r}: want bn/bk/warps/stages[/bm]")
        out.append(lin.TileConfig(*parts))
    return out


def _label(cfg: lin.TileConfig, halved: bool) -> str:
    bm = f" bm{cfg.bm}" if cfg.bm != lin.DEFAULT_TILE.bm else ""
    return f"bn{cfg.bn} bk{cfg.bk} w{cfg.warps} s{cfg.stages}{bm}{' halved' if halved else ''}"


def _cublas_us(x: torch.Tensor, w: torch.Tensor, tiles: tuple | None, reps: int) -> float:
    """The same product on cuBLAS (bf16 out, no tree): the speed the tree is measured against."""
    if tiles is None:
        return timed(lambda: torch.nn.functional.linear(x, w), reps) * 1000
    from rlsys.kernels.triton_ops.products import grouped_mm

    te, tr, tn = tiles
    counts = torch.zeros(w.shape[0], dtype=torch.int64, device=x.device)
    counts.index_add_(0, te.long(), tn.long())
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    return timed(lambda: grouped_mm(x, w.transpose(1, 2), offsets), reps) * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="large")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--decode-rows", type=int, default=64)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument(
        "--configs", default="", help="bn/bk/warps/stages[/bm],... (default: the sweep)"
    )
    parser.add_argument(
        "--halved", choices=("off", "on", "both"), default="off",
        help="`linear.HALVED_TREES` for each configuration (both: off, then on)",
    )  # fmt: skip
    args = parser.parse_args()
    configs = _parse_configs(args.configs) if args.configs else CONFIGS
    switch = {"off": [False], "on": [True], "both": [False, True]}
    print(f"{torch.cuda.get_device_name()} | preset {args.preset} | {N_CHUNKS}-chunk trees")
    for name, x, w, tiles in _cases(args):
        lin.HALVED_TREES = False
        want = _tree(x, w, tiles, configs[0])
        cublas = _cublas_us(x, w, tiles, args.reps)
        print(f"\n{name} (cuBLAS, no tree: {cublas:.1f} us)")
        print("| config | us | vs the first | vs cuBLAS | bits |\n|---|---:|---:|---:|---|")
        base = None
        for cfg in configs:
            for halved in switch[args.halved]:
                lin.HALVED_TREES = halved
                label = _label(cfg, halved)
                try:
                    t = timed(lambda cfg=cfg: _tree(x, w, tiles, cfg), args.reps) * 1000
                    same = torch.equal(_tree(x, w, tiles, cfg), want)
                except Exception as err:  # a configuration the compiler rejects, said so
                    print(f"| {label} | failed: {type(err).__name__} | | | |")
                    continue
                base = base or t
                print(
                    f"| {label} | {t:.1f} | {base / t:.2f}x | {t / cublas:.2f} "
                    f"| {'same' if same else 'DIFFER'} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
