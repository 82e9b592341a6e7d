"""One kernel call per target, for Nsight Compute to read (`scripts/device_run.sh ncu`).

Usage (GPU machine, repository root; ncu filters the kernel and skips the warm-up launch):
    python benchmarks/ncu_targets.py --target prefill --length 32768 --head-dim 64
    ncu --clock-control none --kernel-name regex:_attn_fwd --launch-skip 1 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats --section SourceCounters \
        python benchmarks/ncu_targets.py --target prefill

Targets (the kernel ncu should pick, and the shapes of `bench_attention_walk` /
`bench_indexer`, so a counter reading sits beside those benches' times):
- `prefill`: the Sparse GQA forward walk (`_attn_fwd`) over one packed sequence;
- `prefill-swa`: the SWA forward walk (`_attn_fwd`) over the same sequence;
- `dkv`: the Sparse GQA backward's dK/dV walk (`_attn_bwd_dkv`), the trainer's largest kernel;
- `topk`: the indexer's selection (`_topk_select`) over the sequence's score chunks;
- `decode`: one decode step's Sparse GQA walk (`_attn_fwd_part` or `_attn_fwd`) at
  `--batch` rows of `--length` context.
Each target runs its call `--calls` times (the first compiles; ncu skips it) and
synchronises, so the process ends with every launch done.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_attention import PAGE, SPARSE_STEP, B, T, index_inputs  # noqa: E402
from benchmarks.bench_attention_walk import (  # noqa: E402
    backward_calls,
    decode_calls,
    prefill_calls,
)
from rlsys.kernels.attention_plan import PagedKV, Span, contiguous_table, plan_tiles  # noqa: E402
from rlsys.kernels.triton_ops import attention_bwd  # noqa: E402
from rlsys.kernels.triton_ops.indexer import select_blocks  # noqa: E402

KERNELS = {  # the regex ncu's --kernel-name takes for each target
    "prefill": "_attn_fwd$",
    "prefill-swa": "_attn_fwd$",
    "dkv": "_attn_bwd_dkv",
    "topk": "_topk_select",
    "decode": "_attn_fwd",
}


def _topk_call(length: int, topk: int) -> Callable[[], object]:
    qi, bk = index_inputs(length, "cuda", random_sel=False)
    kv = contiguous_table([length], PAGE, "cuda")
    bkt = PagedKV(kv.block_table // B, PAGE // B)
    tiles = plan_tiles([Span(0, 0, length, 0)], T, "cuda")
    return lambda: select_blocks(
        qi, bk, tiles, bkt, topk_blocks=topk // B, block=B, precision="tf32"
    )


TARGETS: dict[str, Callable[[argparse.Namespace], Callable[[], object]]] = {
    "prefill": lambda a: prefill_calls(a.length, a.head_dim)[0],
    "prefill-swa": lambda a: prefill_calls(a.length, a.head_dim)[1],
    "dkv": lambda a: backward_calls(a.length, a.head_dim)[0],
    "topk": lambda a: _topk_call(a.length, a.topk),
    "decode": lambda a: decode_calls(a.batch, a.length, a.head_dim)[0],
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", choices=sorted(TARGETS), required=True)
    parser.add_argument("--length", type=int, default=32768, help="tokens, or decode context")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=64, help="decode rows")
    parser.add_argument("--topk", type=int, default=4096, help="selected keys per query")
    parser.add_argument("--calls", type=int, default=2)
    parser.add_argument("--dkv-keys", type=int, default=0, help="dK/dV key chunk (0: the step)")
    parser.add_argument("--kernel", action="store_true", help="print the target's ncu regex")
    args = parser.parse_args()
    if args.kernel:
        print(KERNELS[args.target])
        return
    if not torch.cuda.is_available():
        sys.exit("ncu_targets needs a CUDA device (it is what Nsight Compute profiles)")
    attention_bwd.DKV_KEYS = args.dkv_keys or None
    call = TARGETS[args.target](args)
    for _ in range(args.calls):
        call()
    torch.cuda.synchronize()
    kernel = KERNELS[args.target]
    print(f"{args.target}: {args.calls} calls, sparse step {SPARSE_STEP}, dK/dV keys "
          f"{args.dkv_keys or 'step'}, kernel {kernel}")  # fmt: skip


if __name__ == "__main__":
    main()
