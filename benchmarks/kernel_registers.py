"""Registers per thread, spilled stack and shared memory of the attention kernels compiled
for sm_90 on this machine (no GPU needed: `kernels/triton_ops/offline.py`).

Usage: python benchmarks/kernel_registers.py [--head-dims 64,128] [--arch 90]

Each kernel at `large`'s attention geometry (4 heads per KV group, 16-slot query tiles,
bf16 on tensor cores; Sparse GQA 16-key steps, SWA 32-key steps) under the launch options
the project gives it (`forward_launch` for the forward walks, `DQ_LAUNCH` / `DKV_LAUNCH` for
the backward). Programs per SM is 65,536 registers / (threads x registers), the limit the
register file sets (shared memory and the 32-warp cap can set a lower one). The figures are
this machine's Triton version's; the H200's Triton may allocate a few registers differently.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlsys.config.model import preset  # noqa: E402
from rlsys.kernels.triton_ops import attention_bwd, attention_fwd  # noqa: E402
from rlsys.kernels.triton_ops.attention_fwd import (  # noqa: E402
    MMA_WARP_ROWS,
    chunk_constants,
    forward_launch,
)
from rlsys.kernels.triton_ops.attention_split import one_warp_launch  # noqa: E402
from rlsys.kernels.triton_ops.offline import KernelResources, compile_ir, compile_resources  # noqa: E402
from rlsys.model.kv_layout import geometry as kernel_geometry  # noqa: E402

MODULE = "rlsys.kernels.triton_ops"
POINTERS = {
    **dict.fromkeys(("Q", "K", "V", "Out", "GATE", "DO", "DQ", "DK", "DV"), "*bf16"),
    **dict.fromkeys(("LSE", "DELTA", "PM", "PL", "PACC"), "*fp32"),
    **dict.fromkeys(
        (
            "tile_seq",
            "tile_slot0",
            "tile_lo",
            "tile_hi",
            "tile_row",
            "block_table",
            "step_off",
            "step_ids",
            "sel_bits",
            "chunk_seq",
            "chunk_step",
            "seq_len",
            "seq_tile0",
            "seq_ntiles",
            "inv_off",
            "inv_tiles",
        ),
        "*i32",
    ),  # fmt: skip
    **dict.fromkeys(("qk_scale", "sm_scale"), "fp32"),
}
# Strides a launch sees as multiples of 16 (Triton specialises them so): rows of heads x
# head dim elements. The block table's, the bitmap's and a split part's per-head stride (its
# chunk count) vary with the call.
DIVISIBLE = (
    "q_stride_n", "q_stride_h", "k_stride_r", "k_stride_g", "o_stride_n", "o_stride_h",
    "p_stride_n", "gate_stride_n",
)  # fmt: skip


def geometry(d: int, sparse: bool) -> dict[str, object]:
    """The constexprs the model gives the attention kernels (`rlsys.model.kv_layout`), at
    `large`'s geometry with head dim `d`, bf16 on tensor cores."""
    cfg = preset("large")
    geo = kernel_geometry(cfg)
    return {
        "G": cfg.n_heads // cfg.n_kv_groups, "T": geo.query_tile, "D": d, "DP": d,
        "STEP": geo.sparse_step if sparse else geo.swa_step, "PAGE": geo.page_size,
        "BLK": cfg.sparse_block, "SPARSE": sparse, "UPCAST": False, "PRECISION": "tf32",
    }  # fmt: skip


def kernels(d: int) -> list[tuple[str, str, dict[str, object], dict[str, int]]]:
    """(label, module:kernel, extra constexprs, launch) of every kernel in the table."""
    chunks = chunk_constants(256)
    # the decode part walk as a plain decode step launches it: one warp's 16 rows
    one_warp_slots = MMA_WARP_ROWS // int(geometry(d, True)["G"])  # type: ignore[call-overload]
    return [
        ("forward walk", f"{MODULE}.attention_fwd:_attn_fwd",
         {**chunks, "HAS_GATE": True, "PAIRED": attention_fwd.FORWARD_PAIRED_STEPS,
          "CONTIG": attention_fwd.CONTIGUOUS_ROWS},
         forward_launch(d)),
        ("split part", f"{MODULE}.attention_split:_attn_fwd_part",
         {**chunks, "SCAN": 128, "ONE_ROW": True, "SUB": one_warp_slots},
         one_warp_launch(d)),
        # ... and with fewer than ONE_WARP_MIN_PROGRAMS part programs: the whole tile
        ("split part, whole tile", f"{MODULE}.attention_split:_attn_fwd_part",
         {**chunks, "SCAN": 128, "ONE_ROW": True, "SUB": 0},
         forward_launch(d)),
        ("backward dq", f"{MODULE}.attention_bwd:_attn_bwd_dq",
         {"CONTIG": attention_fwd.CONTIGUOUS_ROWS}, attention_bwd.DQ_LAUNCH),
        ("backward dk dv", f"{MODULE}.attention_bwd:_attn_bwd_dkv", {}, attention_bwd.DKV_LAUNCH),
        # the wide key chunk (`attention_bwd.DKV_KEYS`): 64 keys per program
        ("backward dk dv, 64 keys", f"{MODULE}.attention_bwd:_attn_bwd_dkv", {"STEP": 64},
         attention_bwd.DKV_WIDE_LAUNCH),
    ]  # fmt: skip


def resources(label: str, d: int, sparse: bool, arch: int = 90) -> KernelResources:
    """What the kernel `label` of the table uses, compiled for sm_`arch` with its launch."""
    _, kernel, extra, launch = next(k for k in kernels(d) if k[0] == label)
    return compile_resources(
        kernel, POINTERS, {**geometry(d, sparse), **extra}, launch, arch, DIVISIBLE
    )


def intermediate(label: str, d: int, sparse: bool, stage: str = "ttgir", arch: int = 90) -> str:
    """The kernel `label`'s intermediate form (`ttgir`: its MMA and shared-memory layouts),
    compiled as `resources` compiles it."""
    _, kernel, extra, launch = next(k for k in kernels(d) if k[0] == label)
    return compile_ir(
        kernel, POINTERS, {**geometry(d, sparse), **extra}, launch, arch, DIVISIBLE, stage
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--arch", type=int, default=90)
    args = parser.parse_args()
    print(f"sm_{args.arch}, compiled offline on this machine")
    print(
        "\n| kernel | layer | head dim | launch | registers | spilled stack B | programs per SM |"
    )
    print("|---|---|---:|---|---:|---:|---:|")
    for d in (int(x) for x in args.head_dims.split(",")):
        for label, _, _, launch in kernels(d):
            for sparse in (True, False):
                used = resources(label, d, sparse, args.arch)
                threads = 32 * launch["num_warps"]
                per_sm = 65536 // (threads * used.registers)
                shown = ", ".join(f"{k} {v}" for k, v in launch.items())
                print(
                    f"| {label} | {'Sparse GQA' if sparse else 'SWA'} | {d} | {shown} "
                    f"| {used.registers} | {used.stack} | {per_sm} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
