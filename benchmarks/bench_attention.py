"""Sparse GQA and gated SWA kernels at the `deep-92` attention shape, with anchors.

Usage (GPU machine, repository root):
    python benchmarks/bench_attention.py [--lengths 32768,131072] [--reps 5]
    python benchmarks/bench_attention.py --smoke     # tiny shapes, any machine (interpreter)
    python benchmarks/bench_attention.py --chunk 1024 --per-octave 8 --split on   # numerics, split

Shape: 16 query heads, 4 KV groups, head dim 128, bf16; Sparse GQA B=8, k=4096 (512
blocks per query and group), index dim 64 (fp32); SWA window 512.

Selections: index queries are correlated over 64-token spans: qi[t, g] = 0.9 * c[t // 64, g]
+ 0.1 * noise (unit-variance normal parts), block keys i.i.d. normal; so adjacent queries
share most of their top-k (the measured overlap is printed) - our stand-in for a trained
indexer's locality. `--random-selection` draws independent index queries (the worst case
for union tiles). The union size per query tile is reported against k. `--indexer
streamed` makes the selection without the fp32 score buffer (the same blocks; the
registry is `rlsys.kernels.triton_ops.selection`).
Anchors (same run): dense cuDNN/flash SDPA (causal, GQA) and FlexAttention with a
block-sparse mask (128-token blocks, k=4096 tokens, random blocks, no indexer), and Flex
with a sliding-window mask for SWA. Prints markdown tables.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if "--smoke" in sys.argv:  # before triton loads: it picks its driver on import
    os.environ.setdefault("TRITON_INTERPRET", "1")

from benchmarks.device_peaks import describe, device_peak  # noqa: E402
from rlsys.kernels.attention_plan import PagedKV, Span, contiguous_table, plan_tiles  # noqa: E402
from rlsys.kernels.triton_ops import attention_fwd  # noqa: E402
from rlsys.kernels.triton_ops.attention import AttentionShape, packed_attention  # noqa: E402
from rlsys.kernels.triton_ops.attention_fwd import attention_forward  # noqa: E402
from rlsys.kernels.triton_ops.indexer import union_steps  # noqa: E402
from rlsys.kernels.triton_ops.selection import (  # noqa: E402
    METHODS,
    indexer_method,
    select_top_blocks,
)

H, HKV, D, B, IDX, W = 16, 4, 128, 8, 64, 512
T, PAGE, SPARSE_STEP, SWA_STEP = 16, 64, 16, 32


def timed(fn: Callable[[], object], reps: int) -> float:
    """Median milliseconds of `fn` (device events on CUDA, wall clock on the CPU)."""
    fn()
    if not torch.cuda.is_available():
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(1000 * (time.perf_counter() - t0))
        return statistics.median(times)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def kernel_ms(fn: Callable[[], object], prefixes: tuple[str, ...] = ("",)) -> float:
    """GPU milliseconds per call of the kernels whose names start with one of `prefixes`
    (every kernel by default; torch.profiler, 10 calls after 3 warm-ups): an eager call of a
    decode-sized kernel spends more on launches than on the GPU, so event timing measures
    the host."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
    total = sum(e.device_time_total for e in prof.key_averages() if e.key.startswith(prefixes))
    return total / 10 / 1000


def index_inputs(
    length: int, dev: str, random_sel: bool, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    noise = torch.randn(length, HKV, IDX, generator=g)
    if random_sel:
        qi = noise
    else:
        centers = torch.randn(length // 64 + 1, HKV, IDX, generator=g)
        qi = 0.9 * centers.repeat_interleave(64, 0)[:length] + 0.1 * noise
    bk = torch.randn(max(length // B, 1), IDX, generator=g)
    return qi.to(dev), bk.to(dev)


def selection_stats(ids: torch.Tensor, step_off: torch.Tensor, ksel: int) -> dict[str, float]:
    """Adjacent-query Jaccard overlap (group 0) and the union's size per tile against k."""
    sample = ids[:, 0, :].cpu()
    jac = []
    for t in range(max(1, sample.shape[0] - 512), sample.shape[0] - 1, 7):
        a = {int(x) for x in sample[t] if x >= 0}
        b = {int(x) for x in sample[t + 1] if x >= 0}
        if a and b:
            jac.append(len(a & b) / len(a | b))
    steps = (step_off[1:] - step_off[:-1]).float()
    blocks_per_step = SPARSE_STEP // B
    union_blocks = steps * blocks_per_step
    return {
        "overlap": statistics.mean(jac) if jac else float("nan"),
        "union_over_k": float(union_blocks.mean()) / ksel,
        "steps": float(steps.sum()),
    }


def sparse_prefill(length: int, args: argparse.Namespace, dev: str) -> dict[str, float]:
    ksel = args.topk // B
    q = torch.randn(length, H, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(length, HKV, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(length, HKV, D, device=dev, dtype=torch.bfloat16)
    qi, bk = index_inputs(length, dev, args.random_selection)
    kv = contiguous_table([length], PAGE, dev)
    bkt = PagedKV(kv.block_table // B, PAGE // B)
    tiles = plan_tiles([Span(0, 0, length, 0)], T, dev)
    scale = 1 / math.sqrt(D)

    def indexer(ids: bool = False) -> tuple:
        # the engine's call: the bitmap alone (only the trainer's indexer KL reads the ids)
        sel = select_top_blocks(
            qi, bk, tiles, bkt, topk_blocks=ksel, block=B, precision="tf32", ids=ids
        )
        return sel, union_steps(sel, tiles, block=B, step=SPARSE_STEP)

    sel, (off, step_ids) = indexer(ids=True)  # the ids for the overlap statistics
    shape = AttentionShape(scale, SPARSE_STEP, sparse=(off, step_ids, sel.bits), block=B)

    def attend() -> object:
        return attention_forward(q, k, v, tiles, kv, **shape.kwargs())

    def layer() -> object:
        s, (o, i) = indexer()
        return attention_forward(
            q, k, v, tiles, kv, scale=scale, step=SPARSE_STEP, sparse=(o, i, s.bits), block=B
        )

    base = torch.cuda.memory_allocated() if dev == "cuda" else 0
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
    total = timed(layer, args.reps)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if dev == "cuda" else float("nan")
    t_index = timed(indexer, args.reps)
    t_attn = timed(attend, args.reps)
    st = selection_stats(sel.ids, off, ksel)
    attn_flops = st["steps"] * (T * (H // HKV)) * SPARSE_STEP * D * 4
    index_flops = length * HKV * (length / B / 2) * IDX * 2
    out = {"total_ms": total, "index_ms": t_index, "attn_ms": t_attn, "peak_gib": peak, **st}
    out["tflops"] = (attn_flops + index_flops) / (total * 1e-3) / 1e12
    out["needed_tflops"] = (length * H * args.topk * D * 4) / (total * 1e-3) / 1e12
    if length <= args.bwd_max:
        out["bwd_ratio"] = backward_ratio(q, k, v, tiles, kv, shape, length, args.reps)
    return out


def backward_ratio(q, k, v, tiles, kv, shape, length, reps) -> float:  # noqa: ANN001
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    do = torch.randn_like(q)

    def fwd() -> object:
        with torch.no_grad():
            return packed_attention(qg, kg, vg, tiles, kv, [length], shape)

    def fwd_bwd() -> None:
        out, _ = packed_attention(qg, kg, vg, tiles, kv, [length], shape)
        out.backward(do)

    t_f = timed(fwd, reps)
    return (timed(fwd_bwd, reps) - t_f) / t_f


def sdpa_anchor(length: int, reps: int, dev: str) -> float:
    import torch.nn.functional as F

    q = torch.randn(1, H, length, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, HKV, length, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    return timed(
        lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), reps
    )


def flex_anchor(length: int, reps: int, dev: str, kind: str) -> float:
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

    q = torch.randn(1, H, length, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, HKV, length, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    if kind == "swa":

        def window(b, h, qi, ki):  # noqa: ANN001, ANN202
            return (ki <= qi) & (qi - ki < W)

        mask = create_block_mask(window, 1, 1, length, length, device=dev, _compile=dev == "cuda")
    else:
        nb, per = length // 128, 4096 // 128
        g = torch.Generator().manual_seed(0)
        idx = torch.zeros(nb, nb, dtype=torch.int32)
        num = torch.zeros(nb, dtype=torch.int32)
        for i in range(nb):
            chosen = (
                torch.randperm(i, generator=g)[: per - 1].sort().values
                if i
                else torch.zeros(0, dtype=torch.int64)
            )
            row = torch.cat([chosen, torch.tensor([i])])
            idx[i, : row.numel()] = row.to(torch.int32)
            num[i] = row.numel()

        def causal(b, h, qi, ki):  # noqa: ANN001, ANN202
            return ki <= qi

        mask = BlockMask.from_kv_blocks(
            num[None, None].to(dev), idx[None, None].to(dev), BLOCK_SIZE=128, mask_mod=causal
        )
    fn = torch.compile(flex_attention) if dev == "cuda" else flex_attention
    return timed(lambda: fn(q, k, v, block_mask=mask, enable_gqa=True), reps)


def decode(args: argparse.Namespace, dev: str) -> dict[str, float]:
    """One Sparse GQA decode step: `batch` sequences of `context` tokens in a paged pool."""
    batch, ctx, ksel = args.decode_batch, args.decode_context, args.topk // B
    pages = ctx // PAGE
    pool_rows = batch * ctx
    k = torch.randn(pool_rows, HKV, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    perm = torch.randperm(batch * pages, device=dev).view(batch, pages).to(torch.int32)
    kv = PagedKV(perm * PAGE, PAGE)
    bkt = PagedKV(perm * (PAGE // B), PAGE // B)
    g = torch.Generator().manual_seed(1)
    bk = torch.randn(pool_rows // B, IDX, generator=g).to(dev)
    qi = torch.randn(batch, HKV, IDX, generator=g).to(dev)
    q = torch.randn(batch, H, D, device=dev, dtype=torch.bfloat16)
    tiles = plan_tiles([Span(s, s, 1, ctx - 1) for s in range(batch)], T, dev)
    scale = 1 / math.sqrt(D)

    def step() -> object:
        sel = select_top_blocks(
            qi, bk, tiles, bkt, topk_blocks=ksel, block=B, precision="tf32", ids=True
        )
        off, ids = union_steps(sel, tiles, block=B, step=SPARSE_STEP)
        return attention_forward(
            q, k, v, tiles, kv, scale=scale, step=SPARSE_STEP, sparse=(off, ids, sel.bits), block=B
        )

    ms = timed(step, args.reps)
    must_read = batch * ((ctx // B) * IDX * 4 + HKV * (args.topk + B) * D * 2 * 2)
    swa_tiles = tiles

    def swa_step() -> object:
        return attention_forward(q, k, v, swa_tiles, kv, scale=scale, step=SWA_STEP, window=W)

    swa_ms = timed(swa_step, args.reps)
    swa_read = batch * HKV * W * D * 2 * 2
    # bandwidth from the kernels' own time where there is a GPU (events time the launches)
    gpu_ms = kernel_ms(step) if dev == "cuda" else ms
    swa_gpu_ms = kernel_ms(swa_step) if dev == "cuda" else swa_ms
    return {
        "ms": ms,
        "gpu_ms": gpu_ms,
        "gbps": must_read / (gpu_ms * 1e-3) / 1e9,
        "hbm_util": must_read / (gpu_ms * 1e-3) / device_peak().hbm_bytes_per_s,
        "swa_ms": swa_ms,
        "swa_gpu_ms": swa_gpu_ms,
        "swa_hbm_util": swa_read / (swa_gpu_ms * 1e-3) / device_peak().hbm_bytes_per_s,
    }


def swa_prefill(length: int, reps: int, dev: str) -> float:
    q = torch.randn(length, H, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(length, HKV, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    kv = contiguous_table([length], PAGE, dev)
    tiles = plan_tiles([Span(0, 0, length, 0)], T, dev)
    return timed(
        lambda: attention_forward(
            q, k, v, tiles, kv, scale=1 / math.sqrt(D), step=SWA_STEP, window=W
        ),
        reps,
    )


def linear_tax(reps: int, dev: str) -> list[tuple[int, float, float]]:
    """The batch-invariant linear against cuBLAS (F.linear), d=2048 -> 2048, bf16."""
    import torch.nn.functional as F

    from rlsys.kernels.triton_ops.linear import linear_fwd

    w = torch.randn(2048, 2048, device=dev, dtype=torch.bfloat16)
    rows = []
    for m in (1, 64, 1024, 16384):
        x = torch.randn(m, 2048, device=dev, dtype=torch.bfloat16)
        rows.append((m, timed(lambda: linear_fwd(x, w), reps), timed(lambda: F.linear(x, w), reps)))
    return rows


def section(name: str, fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception:  # one failing section must not hide the others' numbers
        print(f"\n{name}: FAILED\n```\n{traceback.format_exc()}```", flush=True)


def main() -> None:
    global T, SPARSE_STEP, PAGE  # the geometry under test (the model derives it from its config)
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", default="32768,131072")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--topk", type=int, default=4096)
    parser.add_argument("--decode-batch", type=int, default=64)
    parser.add_argument("--decode-context", type=int, default=131072)
    parser.add_argument("--bwd-max", type=int, default=32768)
    parser.add_argument("--random-selection", action="store_true")
    parser.add_argument(
        "--indexer", default="buffered", choices=sorted(METHODS), help="the selection's method"
    )
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter)")
    parser.add_argument("--sparse-step", type=int, default=SPARSE_STEP, help="keys per step")
    parser.add_argument("--query-tile", type=int, default=T, help="query slots per tile")
    parser.add_argument("--skip", default="", help="comma list: prefill,anchors,decode,swa,linear")
    parser.add_argument(
        "--chunk", type=int, default=attention_fwd.SOFTMAX_CHUNK,
        help="key positions per softmax chunk (changes the numerics: engine and trainer alike)",
    )  # fmt: skip
    parser.add_argument(
        "--per-octave", type=int, default=attention_fwd.CHUNKS_PER_OCTAVE,
        help="softmax chunks per octave of key positions past the flat ones (numerics, too)",
    )  # fmt: skip
    parser.add_argument(
        "--split", default="auto", choices=["auto", "on", "off"],
        help="decode rows: walk the chunks in parallel (on), in one walk (off), or as the "
        "bounds in attention_fwd pick (auto)",
    )  # fmt: skip
    parser.add_argument(
        "--paired-steps", choices=["on", "off"],
        default="on" if attention_fwd.FORWARD_PAIRED_STEPS else "off",
        help="the single forward walk folds two steps per loop trip, or one (the same bits)",
    )  # fmt: skip
    parser.add_argument(
        "--rescale", choices=["always", "on-demand"],
        default="on-demand" if attention_fwd.RESCALE_ON_DEMAND else "always",
        help="the slack rule's rescale: every step, or on a tile-wide branch (the same bits)",
    )  # fmt: skip
    parser.add_argument(
        "--contiguous-rows", choices=["on", "off"],
        default="on" if attention_fwd.CONTIGUOUS_ROWS else "off",
        help="packed K/V addressed from each sequence's first row, not the page table "
        "(the same bits)",
    )  # fmt: skip
    args = parser.parse_args()
    attention_fwd.CONTIGUOUS_ROWS = args.contiguous_rows == "on"
    attention_fwd.FORWARD_PAIRED_STEPS = args.paired_steps == "on"
    attention_fwd.set_rescale_on_demand(args.rescale == "on-demand")  # before any launch
    attention_fwd.SOFTMAX_CHUNK = args.chunk
    attention_fwd.CHUNKS_PER_OCTAVE = args.per_octave
    if args.split != "auto":  # the split bounds opened wide (on) or shut (off)
        attention_fwd.SPLIT_BELOW_PROGRAMS = 1 << 62 if args.split == "on" else 0
        attention_fwd.SPLIT_MAX_CHUNK_PROGRAMS = 1 << 62
        attention_fwd.SPLIT_ONE_WARP = args.split == "on"
    T, SPARSE_STEP = args.query_tile, args.sparse_step
    PAGE = max(PAGE, SPARSE_STEP)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if args.smoke:
        args.lengths, args.topk, args.decode_batch, args.decode_context, args.reps = (
            "256",
            64,
            2,
            256,
            1,
        )
        args.bwd_max = 256
    skip = set(args.skip.split(","))
    lengths = [int(x) for x in args.lengths.split(",")]
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    print(
        f"device: {name}; torch {torch.__version__}; selection: {'random' if args.random_selection else 'clustered'}"
        f"; sparse step {SPARSE_STEP}, query tile {T}; softmax chunk {args.chunk}"
        f" ({args.per_octave} per octave), split {args.split}; indexer {args.indexer}"
        f"; paired steps {args.paired_steps}"
        f"; rescale {args.rescale}; contiguous rows {args.contiguous_rows}"
    )
    print(describe(device_peak()))

    def prefill() -> None:
        print(
            "\n| tokens | layer ms | indexer ms | attention ms | peak GiB | TFLOP/s computed | TFLOP/s needed | adjacent overlap | union / k | bwd / fwd |"
        )
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for length in lengths:
            r = sparse_prefill(length, args, dev)
            print(
                f"| {length} | {r['total_ms']:.2f} | {r['index_ms']:.2f} | {r['attn_ms']:.2f} | {r['peak_gib']:.2f} "
                f"| {r['tflops']:.0f} | {r['needed_tflops']:.0f} | {r['overlap']:.2f} | {r['union_over_k']:.2f} "
                f"| {r.get('bwd_ratio', float('nan')):.2f} |",
                flush=True,
            )

    def anchors() -> None:
        print(
            "\n| tokens | SDPA dense causal ms | Flex block-sparse ms | Flex SWA ms | our SWA prefill ms |"
        )
        print("|---:|---:|---:|---:|---:|")
        for length in lengths:
            cells = []
            for fn in (
                lambda: sdpa_anchor(length, args.reps, dev),
                lambda: flex_anchor(length, args.reps, dev, "sparse"),
                lambda: flex_anchor(length, args.reps, dev, "swa"),
                lambda: swa_prefill(length, args.reps, dev),
            ):
                try:
                    cells.append(f"{fn():.2f}")
                except Exception as err:  # an anchor that cannot run here says so
                    cells.append(f"n/a ({type(err).__name__})")
            print(f"| {length} | " + " | ".join(cells) + " |", flush=True)

    def decoding() -> None:
        r = decode(args, dev)
        print(
            "\n| decode batch | context | Sparse GQA ms (events) | GPU ms | GB/s | HBM util "
            "| SWA ms (events) | GPU ms | SWA HBM util |"
        )
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        print(
            f"| {args.decode_batch} | {args.decode_context} | {r['ms']:.3f} | {r['gpu_ms']:.3f} "
            f"| {r['gbps']:.0f} | {r['hbm_util']:.0%} | {r['swa_ms']:.3f} | {r['swa_gpu_ms']:.3f} "
            f"| {r['swa_hbm_util']:.0%} |",
            flush=True,
        )

    def linear() -> None:
        print("\n| rows | invariant linear ms | cuBLAS ms | tax |")
        print("|---:|---:|---:|---:|")
        for m, ours, blas in linear_tax(args.reps, dev):
            print(f"| {m} | {ours:.3f} | {blas:.3f} | {ours / blas - 1:+.0%} |", flush=True)

    for key, fn in (
        ("prefill", prefill),
        ("anchors", anchors),
        ("decode", decoding),
        ("linear", linear),
    ):
        if key not in skip:
            with indexer_method(args.indexer):
                section(key, fn)


if __name__ == "__main__":
    main()
