"""Registers and spilled stack of the streamed indexer selection compiled for sm_90 on any
machine (`kernels/triton_ops/offline.py`; no GPU needed).

Usage: python benchmarks/indexer_stream_registers.py [--warps 4,8] [--arch 90]

`_stream_select` at `bench_attention.py`'s `deep-92` shape (4 KV groups, 16-slot query
tiles, index dim 64, B = 8, k = 512 blocks at 128K: 512 bitmap words), tf32 products; and
the two small kernels beside it (tied k-th scores; ids from the bitmap). The figures are this machine's Triton
version's; the device's may allocate a few registers differently.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlsys.kernels.triton_ops import indexer_stream as stream  # noqa: E402
from rlsys.kernels.triton_ops.offline import compile_resources  # noqa: E402

POINTERS = {
    **dict.fromkeys(("BITS", "IDS", "STATE", "PASSES", "SCRATCH"), "*i32"),
    **dict.fromkeys(("tile_seq", "tile_slot0", "tile_lo", "tile_hi", "tile_row"), "*i32"),
    "bk_table": "*i32", "QI": "*fp32", "BK": "*fp32",
}  # fmt: skip
STRIDES = ("qi_stride_n", "qi_stride_g", "bk_stride_r", "bits_stride_r", "ids_stride_r")
SHAPE = {"HKV": 4, "T": 16, "IDX": 64, "IDXP": 64, "NBT": 64, "BPP": 8, "BLK": 8}


def kernels() -> list[tuple[str, dict]]:
    """(kernel, its constexprs) at the deep-92 shape, tf32 products."""
    tiles = {**SHAPE, "KSEL": 512, "UPCAST": False, "PRECISION": "tf32"}
    return [
        ("_stream_bracket", {
            **tiles, "P": stream.PROBES, "C": stream.COLLECT,
            **{f"R{i}": r for i, r in enumerate(stream.FIRST_RATIOS)},
            **{f"F{i}": f for i, f in enumerate(stream.NEXT_FRACTIONS)},
            "MAX_PASSES": stream.MAX_PASSES, "COUNT_PASSES": False,
        }),
        ("_stream_collect", {**tiles, "C": stream.COLLECT}),
        ("_stream_bits", {**tiles, "NWO": 512}),
        ("_stream_ties", {**tiles, "NWO": 512}),
        ("_bits_to_ids", {"NWO": 512, "WB": 64, "KSEL": 512, "KSELP": 512}),
    ]  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--warps", default="4,8")
    p.add_argument("--arch", type=int, default=90)
    args = p.parse_args()
    print(f"the streamed selection's kernels for sm_{args.arch}, deep-92 shape\n")
    print("| kernel | warps | registers | spilled stack B | shared B |\n|---|---:|---:|---:|---:|")
    for name, consts in kernels():
        for warps in (int(w) for w in args.warps.split(",")):
            res = compile_resources(
                f"rlsys.kernels.triton_ops.indexer_stream:{name}", POINTERS, consts,
                {"num_warps": warps, "num_stages": 2}, arch=args.arch,
                divisible=(*STRIDES, "bkt_stride"),
            )  # fmt: skip
            print(f"| `{name}` | {warps} | {res.registers} | {res.stack} | {res.shared} |")


if __name__ == "__main__":
    main()
