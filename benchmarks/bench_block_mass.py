"""GPU kernel time of the indexer KL's block mass (`attention_bwd._block_mass`) beside the
Sparse GQA forward walk over the same selection, one packed prefill sequence.

Usage (GPU machine, a tree's root: the kernels are imported from the working directory, so
the same command times a `git archive` of another commit run from its root):
    python benchmarks/bench_block_mass.py [--length 32768] [--head-dims 64,128] [--warps 1,2]
    python benchmarks/bench_block_mass.py --save /tmp/mass.pt        # keep each head dim's mass
    python benchmarks/bench_block_mass.py --compare /tmp/mass.pt     # ... and diff against it

Shapes are `bench_attention_walk.py`'s prefill: 16 query heads, 4 KV groups, bf16, Sparse GQA
B = 8, k = 4,096 (512 blocks), 16-key steps, index queries correlated over 64-token spans.
Times are the kernels' own GPU time per call (the profiler). `--warps` sets
`MASS_LAUNCH["num_warps"]` (a launch option: the mass's values do not depend on it). The
mass is a training target (no engine value to match): a rewrite may round differently, so
`--compare` prints the largest difference and the largest mass, not only equality.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

ROOT = Path.cwd() if (Path.cwd() / "rlsys").is_dir() else Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_attention import kernel_ms  # noqa: E402
from benchmarks.bench_attention_walk import (  # noqa: E402
    KSEL,
    SPARSE_STEP,
    B,
    prefill_inputs,
    selection,
)
from rlsys.kernels.triton_ops import attention_bwd  # noqa: E402
from rlsys.kernels.triton_ops.attention_fwd import attention_forward  # noqa: E402


def mass_rows(length: int, d: int, warps: list[int], saved: dict, compare: dict | None) -> None:
    q, k, v, tiles, kv, qi, bk, bkt = prefill_inputs(length, d)
    csr = selection(qi, bk, tiles, bkt)
    scale = 1 / math.sqrt(d)

    def forward() -> tuple[torch.Tensor, torch.Tensor]:
        return attention_forward(
            q, k, v, tiles, kv, scale=scale, step=SPARSE_STEP, sparse=csr, block=B
        )

    _, lse = forward()

    def mass() -> torch.Tensor:
        return attention_bwd.block_mass(
            q, k, lse, tiles, kv, csr, KSEL, scale=scale, step=SPARSE_STEP, block=B
        )

    fwd_ms = kernel_ms(forward, ("_attn_fwd",))
    for w in warps:
        attention_bwd.MASS_LAUNCH["num_warps"] = w
        got = mass()
        ms = kernel_ms(mass, ("_block_mass", "_union_steps"))  # with its packed block lists
        saved.setdefault(d, got.cpu())
        note = ""
        if compare is not None and d in compare:
            want = compare[d]
            diff = float((got.cpu() - want).abs().max())
            note = "equal" if torch.equal(got.cpu(), want) else f"max diff {diff:.2e}"
            note += f" (largest mass {float(want.max()):.3f})"
        print(
            f"| {length} | {d} | {w} | {ms:.3f} | {fwd_ms:.3f} | {ms / fwd_ms:.2f} | {note} |",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--length", type=int, default=32768)
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--warps", default="", help="block-mass warps (default: MASS_LAUNCH's)")
    parser.add_argument("--save", default="", help="save each head dim's mass (first warps)")
    parser.add_argument("--compare", default="", help="a --save file to diff against")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_block_mass needs a GPU (it reads the profiler's kernel times)")
    warps = [int(w) for w in args.warps.split(",")] if args.warps else []
    warps = warps or [attention_bwd.MASS_LAUNCH["num_warps"]]
    compare = torch.load(args.compare) if args.compare else None
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; tree {ROOT}; "
          f"MASS_LAUNCH {attention_bwd.MASS_LAUNCH}")  # fmt: skip
    print("\n| tokens | head dim | mass warps | block mass ms | Sparse forward ms | mass / forward "
          "| vs --compare |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---|")
    saved: dict = {}
    for d in (int(x) for x in args.head_dims.split(",")):
        mass_rows(args.length, d, warps, saved, compare)
        torch.cuda.empty_cache()
    if args.save:
        torch.save(saved, args.save)


if __name__ == "__main__":
    main()
