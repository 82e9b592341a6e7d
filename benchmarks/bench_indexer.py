"""Where the Sparse GQA indexer's time goes: block scores, top-k selection, union steps.

Usage (GPU machine, repository root):
    python benchmarks/bench_indexer.py [--lengths 32768,131072] [--reps 5] [--bits-only]
        [--method buffered|streamed]
    python benchmarks/bench_indexer.py --smoke     # tiny shapes, any machine (interpreter)

The `deep-92` shape of `bench_attention.py` (4 KV groups, index dim 64, B = 8, k = 4,096
tokens = 512 blocks, query tile 16, clustered index queries). Per length: the whole
indexer (`select_blocks` + `union_steps`) by device events, and each kernel's share of it
from the profiler (GPU time per kernel name over one call), with the HBM floor of the
score buffer this design writes and reads back (fp32, causal half). Prints a markdown table.
`--bits-only` times the engine's call, which asks for the bitmap alone (the trainer's also
writes the ids the indexer KL reads). `--method` picks the selection's implementation
(`rlsys.kernels.triton_ops.selection`: the fp32 score buffer ranked per row, or the
streamed passes without a buffer); both select the same blocks.

A change to the selection must leave it bitwise the same: `--save FILE` in the tree before
and `--compare FILE` in the tree after (same machine) check every length's ids and bitmaps.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if "--smoke" in sys.argv:  # before Triton is imported: the interpreter is chosen at import
    os.environ.setdefault("TRITON_INTERPRET", "1")

from benchmarks.bench_attention import (  # noqa: E402
    HKV,
    PAGE,
    SPARSE_STEP,
    B,
    T,
    index_inputs,
    timed,
)
from benchmarks.device_peaks import describe, device_peak  # noqa: E402
from rlsys.kernels.attention_plan import PagedKV, Span, contiguous_table, plan_tiles  # noqa: E402
from rlsys.kernels.triton_ops import indexer  # noqa: E402
from rlsys.kernels.triton_ops.indexer import Selection, union_steps  # noqa: E402
from rlsys.kernels.triton_ops.selection import (  # noqa: E402
    METHODS,
    indexer_method,
    select_top_blocks,
)


def kernel_ms(fn, dev: str) -> dict[str, float]:  # noqa: ANN001
    """GPU milliseconds per kernel name over one call of `fn` (empty on the CPU)."""
    if dev != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    per: dict[str, float] = defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name] += ev.device_time / 1000
    return dict(per)


def measure(
    length: int, topk: int, reps: int, dev: str, keep: bool, ids: bool = True
) -> tuple[float, dict[str, float], tuple[torch.Tensor, torch.Tensor] | None]:
    """Indexer ms, ms per kernel, and (when `keep`) the selection's (ids, bits) on the host."""
    qi, bk = index_inputs(length, dev, random_sel=False)
    kv = contiguous_table([length], PAGE, dev)
    bkt = PagedKV(kv.block_table // B, PAGE // B)
    tiles = plan_tiles([Span(0, 0, length, 0)], T, dev)

    def select(with_ids: bool = ids) -> Selection:
        return select_top_blocks(
            qi, bk, tiles, bkt, topk_blocks=topk // B, block=B, precision="tf32", ids=with_ids
        )

    def indexer() -> object:
        return union_steps(select(), tiles, block=B, step=SPARSE_STEP)

    kept = None
    if keep:
        sel = select(with_ids=True)
        assert sel.ids is not None
        kept = (sel.ids.cpu(), sel.bits.cpu())
    return timed(indexer, reps), kernel_ms(indexer, dev), kept


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", default="32768,131072")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--topk", type=int, default=4096)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter)")
    parser.add_argument("--save", help="write each length's selection (ids, bits) to this file")
    parser.add_argument("--compare", help="check each selection bitwise against a --save file")
    parser.add_argument("--bits-only", action="store_true", help="time the engine's call")
    parser.add_argument("--per-thread", type=int, help="a top-k row's blocks per thread")
    parser.add_argument("--method", default="buffered", choices=sorted(METHODS))
    args = parser.parse_args()
    if args.per_thread:
        indexer.SELECT_PER_THREAD = args.per_thread
    if args.smoke:
        args.lengths, args.topk, args.reps = "512", 128, 1
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    what = "bitmap only (the engine's call)" if args.bits_only else "ids and bitmap"
    print(
        f"device: {name}; torch {torch.__version__}; k = {args.topk} tokens, B = {B}; {what}; "
        f"selection {args.method}; {indexer.SELECT_PER_THREAD} blocks per thread in the "
        "buffered top-k"
    )
    print(describe(device_peak()))
    print("\n| tokens | indexer ms | kernel | kernel ms | share | score-buffer HBM floor ms |")
    print("|---:|---:|---|---:|---:|---:|")
    selections: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    keep = bool(args.save or args.compare)
    for length in (int(x) for x in args.lengths.split(",")):
        with indexer_method(args.method):
            total, per, kept = measure(length, args.topk, args.reps, dev, keep, not args.bits_only)
        if kept is not None:
            selections[length] = kept
        # the fp32 scores of every (query, group, past block), written once and read once
        floor = 2 * length * HKV * (length / B / 2) * 4 / device_peak().hbm_bytes_per_s * 1e3
        print(f"| {length} | {total:.2f} | (all) | | | {floor:.2f} |")
        busy = sum(per.values()) or 1.0
        for kname, ms in sorted(per.items(), key=lambda kv: -kv[1])[:6]:
            print(f"| | | `{kname[:40]}` | {ms:.2f} | {ms / busy:.0%} | |")
    if args.save:
        torch.save(selections, args.save)
    if args.compare:
        saved = torch.load(args.compare)
        for length, (ids, bits) in selections.items():
            if length not in saved:
                print(f"{length} tokens: not in {args.compare}")
                continue
            same = torch.equal(ids, saved[length][0]) and torch.equal(bits, saved[length][1])
            print(f"{length} tokens: selection {'bitwise the same' if same else 'DIFFERS'}")


if __name__ == "__main__":
    main()
