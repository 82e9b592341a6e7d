"""Trainer tokens/s, MFU and GPU-busy share on one GPU: `train_step` on long engine-like
sequences, with the invariant products and with every product on plain cuBLAS (the ceiling).

Usage (GPU machine): python benchmarks/bench_trainer_gpu.py [--preset large]
    [--lengths 8192,32768] [--checkpointing off,on] [--repeat 2] [--linear invariant,plain]
    [--pack 1] [--graphs off,on] [--pdl on,off]

Per sequence length and linear mode (`rlsys.kernels.triton_ops.products`: `invariant` is the
engine's forward, `plain` every product on cuBLAS / grouped GEMM with its default
workspace, no chunk tree: the ceiling of the invariant design) one process (cuBLAS's
workspace is fixed when CUDA starts) and one model built on the GPU; each length runs in
every mode before the next; per activation-checkpointing setting: two
trajectories of that length (a 256-token prompt, then policy tokens; behaviour log-probs,
routed experts and top-64 candidate sets recorded by a no-grad packed forward, as the
engine records them), replay on, chunked LM head, one warm-up step, then `--repeat` timed
steps (the best is shown), then one step under the torch profiler for the GPU-busy share:
the time in which a kernel runs (overlaps once) over the best unprofiled step's wall. The
profiler's per-launch callbacks slow the host, so its own wall would undercount a step the
host bounds (`busy_profiled` in the JSON rows: kernel time / profiled wall, the measure
before the twenty-third session). Model
FLOPs per token = 6 x active parameters in matrix products (routed top-k + shared experts,
projections, index projections, LM head) + attention: 12 x heads x head_dim x keys seen per
layer (the SWA window, or Sparse GQA's selected top-k keys) + the indexer's block scores
(6 x groups x index_dim x past blocks). MFU = model FLOPs / step time / the card's dense bf16
peak (`device_peaks`: 989 TFLOP/s on the H200 and the H100 SXM); recomputation under checkpointing is not counted as useful work.
Peak GiB: the allocated peak over the timed steps, and in brackets the reserved peak (what
the process holds: a graph replay's kernels use the graph's memory pool without the
allocator, so only the reserved peak counts it).
`--pack 2` packs both sequences into one micro-batch (`micro_batch_tokens` = 2 x length)
instead of one each: half the launches per token, where the host bounds the step.
`--pdl on,off`: the trunk graphs captured with programmatic dependent launch
(`rlsys.kernels.triton_ops.pdl.TRUNK_GRAPHS`) and without, per linear mode; the anchor
(the ratio's denominator) is the last mode.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.device_peaks import describe, device_peak  # noqa: E402
from rlsys.config.algo import AlgoConfig  # noqa: E402
from rlsys.config.job import TrainerSection  # noqa: E402
from rlsys.config.model import preset  # noqa: E402
from rlsys.engine.route_log import TokenRoutes  # noqa: E402
from rlsys.kernels.dispatch import WORKSPACE_ENV  # noqa: E402
from rlsys.model import RoutingRecorder, Transformer  # noqa: E402
from rlsys.trainer import Trainer  # noqa: E402
from rlsys.trajectory import Segment, Trajectory  # noqa: E402

PROMPT, CANDIDATES = 256, 64


def model_flops(model: Transformer, length: int) -> float:
    """Forward + backward model FLOPs of one sequence of `length` tokens (see module doc)."""
    cfg = model.cfg
    matmul = model.num_parameters(active=True) - model.embed.numel()
    attn = 0.0
    for kind in cfg.layer_kinds():
        for t in range(0, length, 64):  # keys seen, summed in steps of 64 positions
            keys = min(t + 1, cfg.swa_window if kind == "swa" else cfg.sparse_topk)
            attn += 64 * 12 * cfg.n_heads * cfg.head_dim * keys
            if kind == "sparse":
                attn += 64 * 6 * cfg.n_kv_groups * cfg.index_dim * (t // cfg.sparse_block)
    return 6.0 * matmul * length + attn


def trajectory(model: Transformer, length: int, device: str = "cuda") -> Trajectory:
    if length <= PROMPT:  # no policy token: the step would pack nothing to train
        raise SystemExit(
            f"a sequence of {length} tokens has no policy token after the "
            f"{PROMPT}-token prompt: give a length above {PROMPT}"
        )
    tokens = torch.randint(0, min(model.cfg.vocab_size, 256), (length,), device=device)
    recorder = RoutingRecorder()
    with torch.no_grad():
        logits = model(tokens[None], routing=recorder, with_mtp=False).logits[0]
        logp = torch.log_softmax(logits, -1)
        top = logits.topk(CANDIDATES, -1).indices
    routes = recorder.routes()
    idx, gates = routes.indices.cpu(), routes.gates.cpu()
    rows = range(PROMPT - 1, length - 1)
    targets = tokens[PROMPT:]
    picked = logp[PROMPT - 1 : length - 1].gather(-1, targets[:, None])[:, 0].cpu().tolist()
    top_h, targets_h = top.cpu().tolist(), targets.cpu().tolist()
    seg = Segment()
    seg.append(tokens[:PROMPT].tolist(), turn=-1, policy=False)
    seg.append(
        targets_h,
        turn=0,
        policy=True,
        logprobs=picked,
        versions=[0] * len(targets_h),
        candidates=[sorted({*top_h[r], targets_h[j]}) for j, r in enumerate(rows)],
        # as the engine hands them over: one compact block per generation (`TokenRoutes`)
        routed=TokenRoutes(
            {"indices": idx[:, rows].to(torch.uint8), "gates": gates[:, rows].contiguous()}
        ),
    )
    return Trajectory("r0", "g", "t", [seg], reward=1.0)


def kernel_spans(prof: profile) -> list[tuple[float, float]]:
    """(start, end) in microseconds of every GPU kernel and copy the profiler saw, sorted."""
    return sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start
    )


def busy_us(spans: list[tuple[float, float]]) -> float:
    """Microseconds in which at least one of `spans` (sorted) runs: overlaps count once."""
    busy, reach = 0.0, spans[0][0] if spans else 0.0
    for start, end in spans:
        busy += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    return busy


def gpu_busy(step: Callable[[], object]) -> tuple[float, float, float]:
    """(seconds in which a kernel runs, summed kernel seconds, wall seconds) of one call of
    `step` under the profiler."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    events = prof.key_averages()
    kernel_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA")
    return busy_us(kernel_spans(prof)) / 1e6, kernel_us / 1e6, wall


def one(
    model: Transformer, length: int, checkpointing: bool, repeat: int, pack: int, graphs: bool
) -> dict[str, float]:
    torch.manual_seed(0)
    trajs = [trajectory(model, length), trajectory(model, length)]
    trajs[1].reward = 0.0  # a group with variance: the step is not filtered
    section = TrainerSection(
        replay_experts="indices",
        replay_candidates=True,
        lm_head_chunk=1024,
        micro_batch_tokens=pack * length,
        activation_checkpointing=checkpointing,
        cuda_graphs=graphs,
        mismatch_rollouts=0,
    )
    trainer = Trainer(model, section, AlgoConfig(max_staleness=10**6))
    trainer.train_step(trajs)  # warm-up: compiles every kernel (and captures the graphs)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    replays = model.trunk_graphs.replays if model.trunk_graphs is not None else 0
    for _ in range(repeat):
        start = time.perf_counter()
        trainer.train_step(trajs)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    best = min(times)
    if model.trunk_graphs is not None:  # a timed step replays every micro-batch's trunk
        replays = (model.trunk_graphs.replays - replays) / repeat
    peak = torch.cuda.max_memory_allocated() / 2**30
    # a graph replay's kernels write into the graph's memory pool without asking the
    # allocator, so the allocated peak misses them: what the process holds is the reserved
    reserved = torch.cuda.max_memory_reserved() / 2**30
    running_s, kernel_s, wall = gpu_busy(lambda: trainer.train_step(trajs))
    tokens = 2 * length
    return {
        "tok_s": tokens / best,
        "step_s": best,
        "mfu": 2 * model_flops(model, length) / best / device_peak().bf16_flops,
        # the profiler's per-launch callbacks slow the host, not the kernels: the share of
        # the unprofiled step in which a kernel runs (the profiled step's share beside it)
        "busy": min(1.0, running_s / best),
        "busy_profiled": kernel_s / wall,
        "peak_gib": peak,
        "reserved_gib": reserved,
        "graph_replays_per_step": replays,
    }


def run_mode(args: argparse.Namespace) -> None:
    """This process's mode (`RLSYS_LINEAR`): one JSON line per configuration."""
    cfg = preset(args.preset)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Transformer(cfg)
    for length in (int(x) for x in args.lengths.split(",")):
        for ckpt, graphs in settings(args.checkpointing, args.graphs):
            row: dict[str, object] = {"length": length, "ckpt": ckpt, "graphs": graphs}
            try:
                model.set_activation_checkpointing(ckpt == "on")
                row.update(one(model, length, ckpt == "on", args.repeat, args.pack, graphs == "on"))
            except torch.OutOfMemoryError:
                row["oom"] = True
            model.set_trunk_graphs(False)  # frees the captured graphs' memory pool
            model.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            print("ROW " + json.dumps(row), flush=True)


def settings(checkpointing: str, graphs: str) -> list[tuple[str, str]]:
    """(checkpointing, graphs) pairs to run; graphs exclude checkpointing (the config says)."""
    pairs = [(c, g) for c in checkpointing.split(",") for g in graphs.split(",")]
    return [(c, g) for c, g in pairs if not (c == "on" and g == "on")]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="large")
    p.add_argument("--lengths", default="8192,32768")
    p.add_argument("--checkpointing", default="off,on")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--linear", default="invariant,plain", help="comma list of linear modes")
    p.add_argument("--pack", type=int, default=1, help="sequences per micro-batch (1 or 2)")
    p.add_argument("--graphs", default="off", help="comma list: trunk as CUDA graphs off / on")
    p.add_argument(
        "--pdl",
        default="",
        help="comma list: on, off (the trunk graphs' Triton kernels with programmatic "
        "dependent launch, RLSYS_PDL_TRAINER), one set of rows each per linear mode "
        "(default: the module's setting, unnamed)",
    )
    p.add_argument("--child", action="store_true", help="run one mode in this process")
    args = p.parse_args()
    if args.child:
        run_mode(args)
        return
    cfg = preset(args.preset)
    with torch.device("meta"):
        model = Transformer(cfg)
    print(
        f"preset {args.preset}: {model.num_parameters():,} parameters "
        f"({model.num_parameters(active=True):,} active), {cfg.compute_dtype}; "
        f"{torch.cuda.get_device_name()}; 2 sequences per step, {args.pack} per micro-batch, "
        "replay on, chunked LM head"
    )
    print(describe(device_peak()))
    # a mode: a linear mode, with PDL named where --pdl asks for it
    modes = [
        f"{linear}, PDL {dependent}" if dependent else linear
        for linear in args.linear.split(",")
        for dependent in (args.pdl.split(",") if args.pdl else [""])
    ]
    rows: dict[str, list[dict]] = {mode: [] for mode in modes}
    for length in args.lengths.split(","):  # each length for every mode before the next
        for mode in modes:
            linear, _, dependent = mode.partition(", PDL ")
            # plain: cuBLAS with its default workspace (the invariant mode's is set at import)
            env = {
                k: v for k, v in os.environ.items() if linear != "plain" or k not in WORKSPACE_ENV
            }
            env["RLSYS_LINEAR"] = linear
            if dependent:
                env["RLSYS_PDL_TRAINER"] = "1" if dependent == "on" else "0"
            cmd = [sys.executable, __file__, "--child", "--preset", args.preset, "--lengths",
                   length, "--checkpointing", args.checkpointing, "--repeat", str(args.repeat),
                   "--pack", str(args.pack), "--graphs", args.graphs]  # fmt: skip
            # streamed: a call cut off by its time limit still shows the rows it measured
            child = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
            assert child.stdout is not None
            for line in child.stdout:
                if line.startswith("ROW "):
                    rows[mode].append(json.loads(line[4:]))
                    print(f"[{mode}] {line[4:].strip()}", flush=True)
            if child.wait():
                print(f"[{mode}: exit {child.returncode}]", flush=True)
    anchor = modes[-1]
    head = "| tokens/seq | activation ckpt | graphs | linear | tokens/s | step s | MFU | GPU busy"
    print(f"\n{head} | peak GiB (reserved) | vs {anchor} |")
    print("|---:|---|---|---|---:|---:|---:|---:|---:|---:|")
    for mode in modes:
        for i, r in enumerate(rows[mode]):
            if r.get("oom"):
                print(
                    f"| {r['length']} | {r['ckpt']} | {r['graphs']} | {mode} | out of memory "
                    "| | | | | |"
                )
                continue
            ref = rows[anchor][i] if i < len(rows[anchor]) else {}
            ratio = f"{r['tok_s'] / ref['tok_s']:.2f}" if ref.get("tok_s") else ""
            print(
                f"| {r['length']} | {r['ckpt']} | {r['graphs']} | {mode} | {r['tok_s']:,.0f} "
                f"| {r['step_s']:.3f} | {r['mfu']:.1%} | {r['busy']:.0%} "
                f"| {r['peak_gib']:.1f} ({r['reserved_gib']:.1f}) | {ratio} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
