"""Engine decode throughput on the GPU: the paged Triton path through `EngineCore`.

Usage (GPU machine): python benchmarks/bench_engine_gpu.py [--preset medium]
    [--batches 1,16,64] [--prompts 1024] [--gen 64] [--graphs on,off] [--capture start]
    [--budget-s 500]

For each context (prompt length), CUDA-graph mode and batch size: `batch` requests of a
`--prompt`-token prompt decode `--gen` steps all together (the steps while prompts
prefill, and after the first request ends, are not timed); the table gives decode tokens/s at
the median decode step (after the first, which captures the graph; one-off kernel compiles
show in the max), the mean and max step, the share of a decode step spent in the runner's
step (the forward; with graphs also the on-device sampling and the host's fills and copies),
the GPU time of the step's graph replay (CUDA events around it) and the host share (1 - that
over the median step: the part of the step the GPU is not running it), the median GPU gap
between one replay's end and the next one's start (the step's work outside the graph plus
the time the device waited for the host), and HBM utilisation = bytes a decode step must
read (every weight a step touches + the K/V its attention reads) / step time, against 4.8
TB/s, at the median step and over all timed steps (tokens / time: a pipelined step's wall
time alternates around the device's period, so the median alone can mislead). Rows past
`--budget-s` seconds are skipped (the device machine's calls are bounded). `--capture start` (the
engine's default) captures every graph of the ladder when the runner is built: the table's
"capture s" column is that start-up cost, and the max step then holds no capture stall;
`lazy` captures each graph on its first use, inside a timed step. `--kernels plain` runs
the dense projections through cuBLAS (`F.linear`: free reductions, the anchor of the
invariance tax; experts and attention keep their kernels), `invariant` the engine's own.
`--count` prints the kernel launches of one decode forward (graph rows), per block.
`--overlap on,off`: graph rows with decode steps queued ahead on the device (the engine's
default) and without (step by step); with overlap a step's launch-to-results time spans
two engine steps, so "forward share" can pass 100%. `--host-profile N` prints, after each
row, the N functions that took the most host time (cProfile; by own, then by cumulative
time) over its timed decode steps: where the host share goes (use `--capture start`, or
the steps that capture a graph fill the profile). Every row also gives the timed steps in
which a garbage collection ran and the longest such pause (and the slowest step's):
the start-up's objects are frozen first, as the engine replica process does
(`rlsys.engine.gc_freeze`; `--no-gc-freeze` leaves them, as runs before 2026-12-04's
twelfth session did), and collections run after a step, at most a young or a middle one
while the batch is busy (`rlsys.engine.gc_steps`, what the replica does since the
twenty-fourth session; `--no-gc-steps`: the interpreter's own thresholds, inside steps);
a step's time includes the collection after it. `--pdl on,off`: the decode graphs captured
with programmatic dependent launch (`rlsys.kernels.triton_ops.pdl`) and without, one set
of rows each, named in the first cell (default: the module's setting, unnamed);
`--combine-norm on,off` likewise for a block's MoE combine fused into the next block's norm
(`rlsys.model.transformer.DEFER_COMBINE`).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import itertools
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_engine import plain_kernels  # noqa: E402
from benchmarks.device_peaks import describe, device_peak  # noqa: E402
from benchmarks.engine_gc_pauses import Pauses  # noqa: E402
from benchmarks.kernel_count import count_launches  # noqa: E402
from rlsys.config.engine import EngineConfig  # noqa: E402
from rlsys.config.model import ModelConfig, preset  # noqa: E402
from rlsys.config.sampling import SamplingConfig  # noqa: E402
from rlsys.engine import gc_steps  # noqa: E402
from rlsys.engine.api import GenerationRequest  # noqa: E402
from rlsys.engine.core import EngineCore  # noqa: E402
from rlsys.engine.gc_freeze import freeze_startup_objects  # noqa: E402
from rlsys.engine.runner import LaunchedStep  # noqa: E402
from rlsys.engine.runners import make_runner  # noqa: E402
from rlsys.engine.tp_dist import DistTPRunner  # noqa: E402
from rlsys.kernels.triton_ops import linear as lin  # noqa: E402
from rlsys.kernels.triton_ops import pdl  # noqa: E402
from rlsys.model import RoutingRecorder, Transformer, transformer  # noqa: E402
from rlsys.model.decode_layout import StaticDecodeLayout  # noqa: E402


def step_bytes(model: Transformer, batch: int, context: int) -> float:
    """Weights a decode step touches (all experts once batch >= experts / top-k) + K/V read."""
    cfg = model.cfg
    per_expert = 3 * cfg.d_model * cfg.expert_hidden * model.lm_head.element_size()
    routed = min(cfg.n_experts, batch * cfg.experts_per_token)
    expert_params = sum(p.numel() for n, p in model.named_parameters() if ".ffn.w" in n)
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) - expert_params * 2
    weights += cfg.n_layers * routed * per_expert - sum(
        p.numel() * p.element_size() for p in model.mtp.parameters()
    )
    kinds = cfg.layer_kinds()
    kv_tok = 2 * cfg.n_kv_groups * cfg.head_dim * 2
    swa = kinds.count("swa") * min(context, cfg.swa_window) * kv_tok
    sparse = kinds.count("sparse") * (
        min(context, cfg.sparse_topk) * kv_tok + context // cfg.sparse_block * cfg.index_dim * 4
    )
    return weights + batch * (swa + sparse)


def prefill_steps(batch: int, prompt: int, step_tokens: int) -> int:
    """Engine steps the batch's prompts take to prefill, `step_tokens` at a time."""
    return -(-batch * prompt // step_tokens)


def make(  # noqa: ANN201
    model: Transformer, batch: int, prompt: int, args: argparse.Namespace, tp: int, reduce: str,
    graphs: bool, overlap: bool = True,
):  # fmt: skip
    step_tokens = max(batch, 8192)
    # room for the tokens decoded while the last prompts prefill (see `run`)
    room = args.gen + prefill_steps(batch, prompt, step_tokens) + 8
    ecfg = EngineConfig(
        max_running=batch, max_context_tokens=prompt + room, device="cuda",
        max_step_tokens=step_tokens, prefix_cache_tokens=0, tp=tp,
        tp_backend="nccl" if tp > 1 else "threads", cuda_graphs=graphs,
        cuda_graph_capture=args.capture, overlap_decode=overlap,
    )  # fmt: skip
    if tp > 1:
        runner = DistTPRunner(model.cfg, model.state_dict(), tp, "nccl", ecfg.kv_pages(), reduce)
    else:
        runner = make_runner(model.cfg, ecfg, model.state_dict())
    return ecfg, runner


def count_forward(cfg: ModelConfig, runner, core: EngineCore) -> None:  # noqa: ANN001
    """Kernel launches of one decode forward of the running batch, as its graph holds them
    (the fixed-shape step run eagerly once, counted by `benchmarks/kernel_count.py`)."""
    graphs = getattr(runner, "graphs", None)
    caches = [runner.table.caches[s.cache_key] for s in core.running]
    if graphs is None or not caches:
        return
    batch = next(b for b in graphs.ladder if b >= len(caches))
    bucket = next(b for b in graphs.buckets if max(c.length for c in caches) < b)
    layout = StaticDecodeLayout(cfg, graphs.pool, batch, bucket - 1, graphs.scratch)
    layout.fill([1] * len(caches), caches)  # the next token's slots: rewritten by the next step
    with torch.inference_mode(), count_launches() as launches:
        graphs.model.forward_decode(layout.tokens, layout.positions, layout.kv, RoutingRecorder())
    torch.cuda.synchronize()
    print(
        f"decode forward, batch {batch}: {launches.total} launches, "
        f"{launches.total / cfg.n_layers:.1f} per block ({cfg.n_layers} blocks); by kernel:"
    )
    print(launches.table(40))


def run(
    model: Transformer,
    batch: int,
    prompt_len: int,
    runner,
    ecfg,
    gen: int,
    count: bool = False,
    host: cProfile.Profile | None = None,
) -> dict[str, float]:  # noqa: ANN001
    """Time `gen` decode steps of `batch` requests all decoding; `host` profiles them.

    The prompts are prefilled `max_step_tokens` at a time, and a prefilled request decodes
    while the others prefill (decode rows go first), so the first ones have generated up to
    one token per prefill step when the last starts. Each request may generate that many
    more than `gen`, and only steps of the full batch (every request running, none
    prefilling) are timed: a row's "batch" is the number of sequences each timed step
    decodes, not an average over a batch that drains."""
    core = EngineCore(model.cfg, ecfg, runner)
    g = torch.Generator().manual_seed(0)
    extra = prefill_steps(batch, prompt_len, ecfg.max_step_tokens)
    params = SamplingConfig(max_tokens_per_turn=gen + extra + 2)
    for i in range(batch):
        prompt = torch.randint(32, 127, (prompt_len,), generator=g).tolist()
        assert core.add(GenerationRequest(f"r{i}", f"s{i}", prompt, params, seed=0)) is None
    forward_s, steps, tokens, decode_s, first_decode = 0.0, 0, 0, 0.0, True
    step_times: list[float] = []
    orig = runner.step

    def timed_step(keys, chunks, sampling=None):  # noqa: ANN001, ANN202
        nonlocal forward_s
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = orig(keys, chunks, sampling)
        torch.cuda.synchronize()
        forward_s += time.perf_counter() - t0
        return out

    # the GPU time of each graph replay (events around it): the step's device time
    replays: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
    timed_replays: list[list[tuple[torch.cuda.Event, torch.cuda.Event]]] = []
    orig_replay = torch.cuda.CUDAGraph.replay

    def timed_replay(graph: torch.cuda.CUDAGraph) -> None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        orig_replay(graph)
        end.record()
        replays.append((start, end))

    torch.cuda.CUDAGraph.replay = timed_replay  # type: ignore[method-assign]
    orig_launch = getattr(runner, "launch", None)

    def timed_launch(keys, chunks, sampling=None, fed=None):  # noqa: ANN001, ANN202
        # a graph step: from its launch to its results (the host's records of the previous
        # step run in between, overlapping the GPU; with overlap, its results are read in
        # the next engine step, after the step behind it is queued)
        assert orig_launch is not None
        t0 = time.perf_counter()
        launched = orig_launch(keys, chunks, sampling, fed)
        if launched is None:
            return None

        def timed_collect():  # noqa: ANN202
            nonlocal forward_s
            out = launched.collect()
            forward_s += time.perf_counter() - t0
            return out

        return LaunchedStep(timed_collect, launched.tokens)

    if orig_launch is not None:
        runner.launch = timed_launch  # type: ignore[method-assign]
    runner.step = timed_step  # type: ignore[method-assign]
    pauses = Pauses()  # every garbage collection's pause, to match slow steps with them
    gc.callbacks.append(pauses)
    step_gc: list[float] = []  # per timed step: seconds paused in collections
    while core.has_work():  # (a finished request's cache is freed: runners are reusable)
        prefilling = any(s.num_generated == 0 for s in core.running) or core.waiting
        # untimed: prefill steps, and the drain once the first request has finished
        prefilling = prefilling or len(core.running) < batch
        before = core.generated_tokens
        forward_before = forward_s
        timed = not prefilling and not first_decode and host is not None
        if timed:
            host.enable()
        paused_before = pauses.total()
        t0 = time.perf_counter()
        core.step()
        gc_steps.after_step(idle=not core.has_work())  # the replica's scheduler loop does
        if timed:
            host.disable()
        if not prefilling and first_decode:  # compiles / captures: not timed
            first_decode, forward_s = False, forward_before
            if count:
                count_forward(model.cfg, runner, core)
        elif not prefilling:
            step_times.append(time.perf_counter() - t0)
            step_gc.append(pauses.total() - paused_before)
            decode_s += step_times[-1]
            tokens += core.generated_tokens - before
            steps += 1
            # read after the run: a sync here would drain the step queued ahead (overlap)
            timed_replays.append(list(replays))
        else:
            forward_s = forward_before
        replays.clear()
    gc.callbacks.remove(pauses)
    runner.step = orig  # type: ignore[method-assign]
    if orig_launch is not None:
        runner.launch = orig_launch  # type: ignore[method-assign]
    torch.cuda.CUDAGraph.replay = orig_replay  # type: ignore[method-assign]
    torch.cuda.synchronize()
    device_ms = sorted(sum(a.elapsed_time(b) for a, b in step) for step in timed_replays)
    # the device between one replay's end and the next one's start: the step's work outside
    # the graph (fills, copies) plus the time it waited for the host
    flat = [pair for step in timed_replays for pair in step]
    gaps = sorted(end.elapsed_time(start) for (_, end), (start, _) in itertools.pairwise(flat))
    step_ms = 1000 * decode_s / max(steps, 1)
    slowest = max(range(len(step_times)), key=step_times.__getitem__, default=None)
    step_times.sort()
    graphs = getattr(runner, "graphs", None)
    return {
        "median_ms": 1000 * step_times[len(step_times) // 2] if step_times else 0.0,
        "max_ms": 1000 * step_times[-1] if step_times else 0.0,
        # garbage collections inside timed steps: how many steps paused, and for how long
        # the slowest step was paused (a full collection stalls the steps queued ahead)
        "gc_steps": sum(1 for p in step_gc if p > 0),
        "gc_max_ms": 1000 * max(step_gc, default=0.0),
        "gc_slowest_ms": 1000 * step_gc[slowest] if slowest is not None else 0.0,
        "replays": graphs.steps if graphs is not None else 0,
        # the median step: one-off kernel compiles and graph captures are not throughput
        "tok_s": batch / step_times[len(step_times) // 2] if step_times else 0.0,
        "step_ms": step_ms,
        "forward_share": forward_s / decode_s if decode_s else 0.0,
        # median GPU time of a step's graph replay, and the share of the median step the
        # GPU is not running it (host work: scheduling, records, sampling off the graph)
        "device_ms": device_ms[len(device_ms) // 2] if device_ms else 0.0,
        "gap_ms": gaps[len(gaps) // 2] if gaps else 0.0,
        # every timed step: a pipelined step's wall time alternates around the GPU's period
        "mean_tok_s": tokens / decode_s if decode_s else 0.0,
        "hbm": step_bytes(model, batch, prompt_len)
        / step_times[len(step_times) // 2]
        / device_peak().hbm_bytes_per_s
        if step_times
        else 0.0,
        # a whole-batch step's bytes per batch-token over the tokens of every timed step
        "mean_hbm": step_bytes(model, batch, prompt_len)
        * tokens
        / batch
        / decode_s
        / device_peak().hbm_bytes_per_s
        if decode_s
        else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="medium")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--prompts", default="1024", help="comma list of prompt lengths")
    parser.add_argument("--gen", type=int, default=64)
    parser.add_argument("--graphs", default="on,off", help="comma list: on, off (TP=1)")
    parser.add_argument("--capture", default="start", choices=["start", "lazy"])
    parser.add_argument("--tp", default="1", help="comma list of TP degrees (NCCL, one GPU each)")
    parser.add_argument("--reduce", default="tree", help="comma list: tree (invariant), allreduce")
    parser.add_argument("--budget-s", type=float, default=1e9)
    parser.add_argument("--kernels", default="invariant", help="comma list: invariant, plain")
    parser.add_argument(
        "--overlap", default="on", help="comma list: on, off (decode steps queued ahead)"
    )
    parser.add_argument(
        "--count", action="store_true", help="print the kernel launches of one decode forward"
    )
    parser.add_argument(
        "--host-profile", type=int, default=0, help="print the N costliest host functions"
    )
    parser.add_argument(
        "--gc-freeze",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="gc.freeze() once the runner is built, as the engine replica does at start-up "
        "(the default since the twelfth session; --no-gc-freeze for the bare core)",
    )
    parser.add_argument(
        "--gc-steps",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="collections after a step, never inside one, as the replica does "
        "(rlsys.engine.gc_steps; --no-gc-steps: the interpreter's thresholds)",
    )
    parser.add_argument(
        "--router-tile",
        default="",
        help="comma list of bm/bn/warps/stages: the fp32 router product's tile, one set of "
        "rows each (A/B of linear.FP32_TILES; default: the table's choice)",
    )
    parser.add_argument(
        "--pdl",
        default="",
        help="comma list: on, off (decode graphs' kernels with programmatic dependent launch; "
        "pdl.DECODE_GRAPHS), one set of rows each (default: the module's setting)",
    )
    parser.add_argument(
        "--combine-norm",
        default="",
        help="comma list: on, off (a block's MoE combine fused into the next block's norm; "
        "transformer.DEFER_COMBINE), one set of rows each (default: the module's setting)",
    )
    args = parser.parse_args()
    started = time.perf_counter()
    torch.manual_seed(0)
    cfg = preset(args.preset).with_overrides({"compute_dtype": "bfloat16"})
    router = (cfg.n_experts, cfg.d_model)
    tiles = [router_tile(t) for t in args.router_tile.split(",")] if args.router_tile else [None]
    print(f"router tile (the table's): {lin.tile_for(*router, torch.float32)}")
    model = Transformer(cfg).cuda().eval()
    print(
        f"preset {args.preset}: {model.num_parameters():,} parameters "
        f"({model.num_parameters(active=True):,} active), {cfg.compute_dtype}; "
        f"{torch.cuda.get_device_name()}"
    )
    print(describe(device_peak()))
    print(
        "\n| kernels | TP | reduction | graphs | batch | context | decode tokens/s (median step) "
        "| tokens/s (all steps) | step ms: mean (median / max) | forward share | GPU ms (graph) "
        "| GPU gap ms | host share | HBM util (median step) | HBM util (all steps) "
        "| graph replays | graphs captured (s) | steps with a GC pause | GC pause ms: max (slowest step) |"
    )
    print(
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    settings = [d == "on" for d in args.pdl.split(",")] if args.pdl else [pdl.DECODE_GRAPHS]
    combines = (
        [c == "on" for c in args.combine_norm.split(",")]
        if args.combine_norm
        else [transformer.DEFER_COMBINE]
    )
    for dependent, deferred, tile, kernels, prompt in (
        (d, c, t, k, int(p))
        for d in settings
        for c in combines
        for t in tiles
        for k in args.kernels.split(",")
        for p in args.prompts.split(",")
    ):
        label_k = kernels
        if tile is not None:  # the router's tile for these rows, named in their first cell
            lin.FP32_TILES[router] = tile
            label_k += f", router {tile.bm}/{tile.bn}/{tile.warps}/{tile.stages}"
        pdl.DECODE_GRAPHS = dependent  # read when the runner captures its graphs
        if args.pdl:
            label_k += f", PDL {'on' if dependent else 'off'}"
        transformer.DEFER_COMBINE = deferred
        if args.combine_norm:
            label_k += f", combine+norm {'on' if deferred else 'off'}"
        for tp in (int(t) for t in args.tp.split(",")):
            for reduce in args.reduce.split(",") if tp > 1 else ["-"]:
                for graphs, overlap in (
                    (g, o == "on")
                    for g in (args.graphs.split(",") if tp == 1 else ["off"])
                    for o in (args.overlap.split(",") if g == "on" else ["off"])
                ):
                    label = f"{graphs}{' + overlap' if overlap else ''}"
                    for batch in (int(b) for b in args.batches.split(",")):
                        head = f"| {label_k} | {tp} | {reduce} | {label} | {batch} | {prompt} "
                        if time.perf_counter() - started > args.budget_s:
                            print(head + "| skipped (budget) |")
                            continue
                        row = measure(
                            model, args, kernels, tp, reduce, graphs == "on", batch, prompt,
                            overlap,
                        )  # fmt: skip
                        print(head + row, flush=True)


def router_tile(spec: str) -> lin.TileConfig:
    """`--router-tile`'s bm/bn/warps/stages as a tile (K step 64, the dense default)."""
    bm, bn, warps, stages = (int(v) for v in spec.split("/"))
    return lin.TileConfig(bn=bn, bk=64, warps=warps, stages=stages, bm=bm)


def measure(  # noqa: PLR0913
    model: Transformer, args: argparse.Namespace, kernels: str, tp: int, reduce: str,
    graphs: bool, batch: int, prompt: int, overlap: bool = True,
) -> str:  # fmt: skip
    """One table row (after its first cells): build the runner, decode, tear it down."""
    # the swap covers the runner's construction: graphs captured at start record what runs
    swap = plain_kernels() if kernels == "plain" else contextlib.nullcontext()
    with swap:
        ecfg, runner = make(
            model, batch, prompt, args, tp, reduce if tp > 1 else "tree", graphs, overlap
        )
        captured = getattr(runner, "graphs", None)
        if args.gc_freeze:
            freeze_startup_objects()
        if args.gc_steps:
            gc_steps.take_over()
        host = cProfile.Profile() if args.host_profile else None
        try:
            r = run(model, batch, prompt, runner, ecfg, args.gen, args.count and graphs, host)
            if captured is not None:
                capture = f"{len(captured.graphs)} ({captured.capture_s:.1f})"
            else:
                capture = "-"
        finally:
            gc_steps.give_back()
            runner.close()
            del runner, captured
            # a frozen runner held in reference cycles is never collected: the next row's
            # pools would not fit (a 32K row after another OOMed) without the unfreeze
            if args.gc_freeze:
                gc.unfreeze()
            gc.collect()
            torch.cuda.empty_cache()
    if host is not None:
        print(f"host profile, batch {batch}, context {prompt}, graphs {graphs}:", file=sys.stderr)
        stats = pstats.Stats(host, stream=sys.stderr)
        stats.sort_stats("tottime").print_stats(args.host_profile)
        stats.sort_stats("cumulative").print_stats(args.host_profile)
    host = f"{1 - r['device_ms'] / r['median_ms']:.0%}" if r["device_ms"] else "-"
    device = f"{r['device_ms']:.2f}" if r["device_ms"] else "-"
    gap = f"{r['gap_ms']:.2f}" if r["device_ms"] else "-"
    return (
        f"| {r['tok_s']:.0f} | {r['mean_tok_s']:.0f} | {r['step_ms']:.2f} ({r['median_ms']:.2f} / "
        f"{r['max_ms']:.0f}) | {r['forward_share']:.0%} | {device} | {gap} | {host} "
        f"| {r['hbm']:.1%} | {r['mean_hbm']:.1%} | {r['replays']} | {capture} "
        f"| {r['gc_steps']} | {r['gc_max_ms']:.1f} ({r['gc_slowest_ms']:.1f}) |"
    )


if __name__ == "__main__":
    main()
