"""GPU kernel time of the attention forward's walks, decode and prefill, from the profiler.

Usage (GPU machine, repository root):
    python benchmarks/bench_attention_walk.py                  # single walk, head dims 64, 128
    python benchmarks/bench_attention_walk.py --split-sweep    # single vs split walk, 4K decode
    python benchmarks/bench_attention_walk.py --maxnreg 128    # a register cap for every dim
    python benchmarks/bench_attention_walk.py --stages 4       # deeper load pipelining
    python benchmarks/bench_attention_walk.py --split-sweep --contexts 4096,131072
    python benchmarks/bench_attention_walk.py --backward --dkv-maxnreg 0,168,200  # trainer
    python benchmarks/bench_attention_walk.py --backward --dkv-keys 0,32,64  # dK/dV chunks
    python benchmarks/bench_attention_walk.py --split-sweep --head-dims 64 --batches 64,256 \
        --contexts 4096,131072 --one-warp-maxnreg 0,168    # the one-warp part walk's cap

Times are the attention kernels' own GPU time per call (`bench_attention.kernel_ms`: the
profiler; event timing of an eager decode-sized call measures the host). Shapes: 16 query
heads, 4 KV groups, bf16; Sparse GQA B = 8, k = 4,096 (512 blocks), 16-key steps
(`--sparse-step`); SWA window 512, 32-key steps; decode rows at position context - 1 in a
paged pool (random pages); prefill one 32K sequence (`--tile` slots per program) with
index queries correlated over 64-token spans (adjacent queries share most of their
top-k); `--backward` times dq and dK/dV of that sequence. The registers per thread and
spills of the single-walk kernel are Triton's. For a before/after, run it from a
`git archive` of the other commit.
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_attention import kernel_ms  # noqa: E402
from rlsys.kernels.attention_plan import (  # noqa: E402
    PagedKV,
    QueryTiles,
    Span,
    contiguous_table,
    plan_tiles,
)
from rlsys.kernels.triton_ops import attention_bwd, attention_fwd, attention_split  # noqa: E402
from rlsys.kernels.triton_ops.attention_bwd import attention_backward  # noqa: E402
from rlsys.kernels.triton_ops.attention_fwd import attention_forward  # noqa: E402
from rlsys.kernels.triton_ops.indexer import select_blocks, union_steps  # noqa: E402

H, HKV, B, IDX, PAGE, KSEL, WINDOW = 16, 4, 8, 64, 64, 512, 512
ATTENTION_KERNELS = ("_attn",)  # the walks and the split's merge; not the selection
SPARSE_STEP, SWA_STEP, T = 16, 32, 16
# a prefill's query tile (--tile; a sweep's knob: on the H200 rows' bits change with it, so
# engine and trainer share the model's `KernelGeometry.query_tile`)
PREFILL_T = T
# decode rows walk once unless a table asks (commits before the split walk lack the option)
ONE_WALK = {"split": False} if "split" in inspect.signature(attention_forward).parameters else {}


def selection(
    qi: torch.Tensor, bk: torch.Tensor, tiles: QueryTiles, bkt: PagedKV
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Sparse GQA selection of these rows as the attention kernels take it: (step
    offsets, step ids, selection bitmap)."""
    sel = select_blocks(qi, bk, tiles, bkt, topk_blocks=KSEL, block=B, precision="tf32")
    off, ids = union_steps(sel, tiles, block=B, step=SPARSE_STEP)
    return off, ids, sel.bits


def forward_pair(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tiles: QueryTiles, kv: PagedKV,
    qi: torch.Tensor, bk: torch.Tensor, bkt: PagedKV,
) -> tuple[Callable, Callable]:  # fmt: skip
    """(sparse, swa): the forward over these rows, Sparse GQA (its selection made here,
    once) and SWA; each takes `attention_forward`'s keyword options."""
    csr = selection(qi, bk, tiles, bkt)
    scale = 1 / math.sqrt(q.shape[-1])

    def sparse(**kw: object) -> object:
        return attention_forward(
            q, k, v, tiles, kv, scale=scale, step=SPARSE_STEP, sparse=csr, block=B, **kw,
        )  # fmt: skip

    def swa(**kw: object) -> object:
        return attention_forward(
            q, k, v, tiles, kv, scale=scale, step=SWA_STEP, window=WINDOW, **kw
        )

    return sparse, swa


def decode_calls(batch: int, ctx: int, d: int) -> tuple[Callable, Callable]:
    """(sparse, swa) forward calls of one decode step of `batch` rows at `ctx` context."""
    dev = "cuda"
    k = torch.randn(batch * ctx, HKV, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    perm = torch.randperm(batch * ctx // PAGE, device=dev).view(batch, -1).to(torch.int32)
    kv, bkt = PagedKV(perm * PAGE, PAGE), PagedKV(perm * (PAGE // B), PAGE // B)
    g = torch.Generator().manual_seed(1)
    bk = torch.randn(batch * ctx // B, IDX, generator=g).to(dev)
    qi = torch.randn(batch, HKV, IDX, generator=g).to(dev)
    q = torch.randn(batch, H, d, device=dev, dtype=torch.bfloat16)
    tiles = plan_tiles([Span(s, s, 1, ctx - 1) for s in range(batch)], T, dev)
    return forward_pair(q, k, v, tiles, kv, qi, bk, bkt)


def prefill_inputs(length: int, d: int) -> tuple:
    """(q, k, v, tiles, kv, qi, bk, bkt) of one packed sequence of `length` tokens."""
    dev = "cuda"
    g = torch.Generator().manual_seed(2)
    q = torch.randn(length, H, d, generator=g).to(dev, torch.bfloat16)
    k = torch.randn(length, HKV, d, generator=g).to(dev, torch.bfloat16)
    v = torch.randn_like(k)
    centre = torch.randn(length // 64 + 1, HKV, IDX, generator=g).repeat_interleave(64, 0)
    qi = (0.9 * centre[:length] + 0.1 * torch.randn(length, HKV, IDX, generator=g)).to(dev)
    bk = torch.randn(length // B, IDX, generator=g).to(dev)
    kv, bkt = contiguous_table([length], PAGE, dev), contiguous_table([length // B], PAGE // B, dev)
    tiles = plan_tiles([Span(0, 0, length, 0)], PREFILL_T, dev)
    return q, k, v, tiles, kv, qi, bk, bkt


def prefill_calls(length: int, d: int) -> tuple[Callable, Callable]:
    """(sparse, swa) forward calls over one packed sequence of `length` tokens."""
    return forward_pair(*prefill_inputs(length, d))


def backward_calls(length: int, d: int) -> tuple[Callable, Callable]:
    """(sparse, swa) backward calls (dq, dK/dV) over one packed sequence of `length` tokens,
    at the forward's output and LSE."""
    q, k, v, tiles, kv, qi, bk, bkt = prefill_inputs(length, d)
    csr = selection(qi, bk, tiles, bkt)
    scale = 1 / math.sqrt(d)
    do = torch.randn_like(q)

    def call(step: int, **kw: object) -> Callable:
        out, lse = attention_forward(q, k, v, tiles, kv, scale=scale, step=step, **kw)
        return lambda: attention_backward(
            do, q, k, v, out, lse, tiles, kv, [length], scale=scale, step=step, **kw
        )

    sparse = call(SPARSE_STEP, sparse=csr, block=B)
    return sparse, call(SWA_STEP, window=WINDOW)


def compiled(kernel: object) -> dict[object, object]:
    """Every compiled variant of a Triton kernel so far, by its cache key."""
    found = {}
    for cache in kernel.device_caches.values():  # type: ignore[attr-defined]
        found.update(cache[0])
    return found


def single_walk_kernels() -> dict[object, object]:
    return compiled(attention_fwd._attn_fwd)


def walk_table(head_dims: list[int]) -> None:
    print("\n| head dim | decode 64 x 128K Sparse ms | SWA ms | decode 64 x 4K Sparse ms | SWA ms "
          "| prefill 32K Sparse ms | SWA ms | single walk regs/spills |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|---|")
    for d in head_dims:
        before = single_walk_kernels()
        cells = []
        for make in (lambda: decode_calls(64, 131072, d), lambda: decode_calls(64, 4096, d),
                     lambda: prefill_calls(32768, d)):  # fmt: skip
            sparse, swa = make()
            cells += [
                f"{kernel_ms(lambda f=f: f(**ONE_WALK), ATTENTION_KERNELS):.3f}"
                for f in (sparse, swa)
            ]
            del sparse, swa
            torch.cuda.empty_cache()
        regs = [f"{k.n_regs}/{k.n_spills}" for key, k in single_walk_kernels().items()
                if key not in before]  # fmt: skip
        print(f"| {d} | " + " | ".join(cells) + f" | {', '.join(regs)} |", flush=True)


def split_table(d: int, ctx: int, batches: list[int]) -> None:
    print(f"\n| decode batch at {ctx} (head dim {d}) | programs | Sparse one walk ms | split ms "
          "| SWA one walk ms | split ms |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|")
    for batch in batches:
        sparse, swa = decode_calls(batch, ctx, d)
        cells = [f"{kernel_ms(lambda s=s, f=f: f(split=s), ATTENTION_KERNELS):.3f}"
                 for f in (sparse, swa) for s in (False, True)]  # fmt: skip
        print(f"| {batch} | {batch * HKV} | " + " | ".join(cells) + " |", flush=True)
        del sparse, swa
        torch.cuda.empty_cache()


def backward_table(
    head_dims: list[int],
    caps: list[int],
    length: int,
    keys: list[int],
    wide_launches: list[tuple[int, int]] | None = None,
) -> None:
    """dq and dK/dV kernel time of one sequence's backward per dK/dV key chunk (`keys`, 0:
    the forward's step; `attention_bwd.DKV_KEYS`), register cap and, for the wider chunks,
    (warps, stages) (`wide_launches`; None: `DKV_WIDE_LAUNCH` as it is), with the wider
    chunks' largest dK/dV difference from the step's (the same sums over other tile
    groupings: rounding only)."""
    print(f"\n| head dim | dK/dV keys | dK/dV maxnreg | warps/stages | Sparse dq ms | Sparse dK/dV ms "
          f"| SWA dq ms | SWA dK/dV ms | dK/dV regs/spills "
          f"| max abs dK, dV diff vs step (Sparse; SWA) | ({length} tokens) |")  # fmt: skip
    print("|---:|---:|---:|---|---:|---:|---:|---:|---|---|---|")
    wide = attention_bwd.DKV_WIDE_LAUNCH
    default_wide = (wide["num_warps"], wide["num_stages"])
    chunks = dict(attention_bwd.DKV_CHUNKS)
    attention_bwd.DKV_CHUNKS.clear()  # "step" rows walk the step, as the table says
    for d in head_dims:
        sparse, swa = backward_calls(length, d)
        attention_bwd.DKV_KEYS = None
        reference = [f()[1:] for f in (sparse, swa)]
        runs = [
            (width, cap, ws)
            for width, cap in itertools.product(keys, caps)
            for ws in ([None] if not width else (wide_launches or [default_wide]))
        ]
        for width, cap, ws in runs:
            attention_bwd.DKV_KEYS = width or None
            launch = attention_bwd.DKV_LAUNCH if not width else attention_bwd.DKV_WIDE_LAUNCH
            if ws is not None:
                launch["num_warps"], launch["num_stages"] = ws
            launch.pop("maxnreg", None)
            if cap:
                launch["maxnreg"] = cap
            before = set(compiled(attention_bwd._attn_bwd_dkv))
            # dq's time includes its packed block lists where it builds them (`_union_steps`)
            cells = [f"{kernel_ms(f, names):.3f}" for f in (sparse, swa)
                     for names in (("_attn_bwd_dq", "_union_steps"), ("_attn_bwd_dkv",))]  # fmt: skip
            regs = [f"{k.n_regs}/{k.n_spills}" for key, k in
                    compiled(attention_bwd._attn_bwd_dkv).items() if key not in before]  # fmt: skip
            diffs = [
                max(
                    float((a.float() - b.float()).abs().max())
                    for a, b in zip(got, want, strict=True)
                )
                for got, want in zip((f()[1:] for f in (sparse, swa)), reference, strict=True)
            ]
            shown = f"{ws[0]}/{ws[1]}" if ws else "-"
            print(f"| {d} | {width or 'step'} | {cap or '-'} | {shown} | " + " | ".join(cells)
                  + f" | {', '.join(regs)} | {diffs[0]:.2e}; {diffs[1]:.2e} | |",
                  flush=True)  # fmt: skip
        attention_bwd.DKV_KEYS = None
        wide["num_warps"], wide["num_stages"] = default_wide
        del sparse, swa, reference
        torch.cuda.empty_cache()
    attention_bwd.DKV_CHUNKS.update(chunks)


def main() -> None:
    global PREFILL_T, SPARSE_STEP
    parser = argparse.ArgumentParser()
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--split-sweep", action="store_true")
    parser.add_argument("--contexts", default="4096", help="decode contexts of --split-sweep")
    parser.add_argument("--batches", default="1,8,16,32,64", help="decode batches of --split-sweep")
    parser.add_argument("--backward", action="store_true", help="the trainer's backward kernels")
    parser.add_argument("--dkv-maxnreg", default="0", help="dK/dV register caps (0: none)")
    parser.add_argument("--dkv-keys", default="0,64", help="dK/dV key chunks (0: the step)")
    parser.add_argument(
        "--dkv-wide-launch", default="",
        help="warps/stages,... of the wider dK/dV chunks (default: DKV_WIDE_LAUNCH)",
    )  # fmt: skip
    parser.add_argument(
        "--dq-launch", default="",
        help="warps/stages,... of dq (--backward once per launch; default: DQ_LAUNCH)",
    )  # fmt: skip
    parser.add_argument("--length", type=int, default=32768, help="--backward's sequence")
    parser.add_argument(
        "--tile", type=int, default=PREFILL_T, help="query slots per program (prefill)"
    )
    parser.add_argument(
        "--sparse-step", type=int, default=SPARSE_STEP, help="Sparse GQA keys per step"
    )
    parser.add_argument("--maxnreg", type=int, default=0, help="cap registers at every dim")
    parser.add_argument(
        "--one-warp-maxnreg", default="",
        help="--split-sweep once per register cap of the one-warp part walk (0: the whole "
        "tile's cap); the same bits",
    )  # fmt: skip
    parser.add_argument(
        "--stages", type=int, default=0,
        help="software-pipeline stages of the forward (a launch option: the same bits)",
    )  # fmt: skip
    args = parser.parse_args()
    PREFILL_T, SPARSE_STEP = args.tile, args.sparse_step
    if not torch.cuda.is_available():
        sys.exit("bench_attention_walk needs a GPU (it reads the profiler's kernel times)")
    if args.maxnreg:
        attention_fwd.FORWARD_LAUNCH["maxnreg"] = args.maxnreg
    if args.stages:
        attention_fwd.FORWARD_LAUNCH["num_stages"] = args.stages
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; softmax chunk "
          f"{attention_fwd.SOFTMAX_CHUNK}, {attention_fwd.CHUNKS_PER_OCTAVE} per octave; "
          f"launch {attention_fwd.FORWARD_LAUNCH}; prefill query tile {PREFILL_T}; "
          f"Sparse GQA step {SPARSE_STEP}")  # fmt: skip
    dims = [int(x) for x in args.head_dims.split(",")]
    if args.backward:
        dq_launches = (
            [item.split("/") for item in args.dq_launch.split(",")] if args.dq_launch else []
        )
        for warps, stages in dq_launches or [(None, None)]:
            if warps is not None:  # dq's launch is a launch option: the same bits
                attention_bwd.DQ_LAUNCH.update(num_warps=int(warps), num_stages=int(stages))
                print(f"\ndq launch: {attention_bwd.DQ_LAUNCH}")
            backward_table(
                dims,
                [int(x) for x in args.dkv_maxnreg.split(",")],
                args.length,
                [int(x) for x in args.dkv_keys.split(",")],
                [
                    (int(w), int(st))
                    for w, st in (item.split("/") for item in args.dkv_wide_launch.split(","))
                ]
                if args.dkv_wide_launch
                else None,
            )
    elif args.split_sweep:
        caps = [int(x) for x in args.one_warp_maxnreg.split(",")] if args.one_warp_maxnreg else []
        for cap in caps or [0]:
            attention_split.ONE_WARP_LAUNCH.clear()
            if cap:
                attention_split.ONE_WARP_LAUNCH["maxnreg"] = cap
            if caps:
                launch = attention_split.one_warp_launch(64)
                print(f"\none-warp part walk's launch at head dim 64: {launch}")
            for d in dims:
                for ctx in (int(x) for x in args.contexts.split(",")):
                    split_table(d, ctx, [int(b) for b in args.batches.split(",")])
    else:
        walk_table(dims)


if __name__ == "__main__":
    main()
