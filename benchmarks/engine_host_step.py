"""The host's share of a decode step on the GPU engine's path (CPU, the native engine).

Usage: python benchmarks/engine_host_step.py [--batch 256] [--prompt 2] [--steps 40] [--rounds 3]
    [--device-work replayed|real] [--breakdown]
    python benchmarks/engine_host_step.py --layout-contexts 256,4096 [--batch 256]

`--batch` requests decode through `EngineCore` on the decode-graph path with overlap, as the
GPU engine runs it (on the CPU the graphs' fixed-shape step runs eagerly through Triton's
interpreter; `tiny` cut to one SWA and one Sparse GQA block). What is timed is the host's
work per steady decode step (every request decoding, the next step queued ahead):
scheduling, the launch (layout and sampling buffers), reading the drawn tokens, the
per-token records, routes and stop checks. With overlap this runs while the GPU computes
the step queued ahead, so once it is longer than the GPU's step the GPU idles between
replays (`bench_engine_gpu.py`'s gap); it does not depend on the model's depth or width.

The device's work of a step (`DecodeGraphs._forward`: a graph replay on the GPU, the
interpreter here) is never counted. `--device-work replayed` (default): the first decode
step's outputs are returned again by every later one instead of re-running the
interpreter (a minute per step at batch 256); the host's work is the same for any values
(every request keeps decoding). The start-up's objects are frozen out of the garbage
collector's walks before the first step, as the replica does at start-up
(`rlsys.engine.gc_freeze`). `--device-work real` re-runs it and takes its time out
(slow; `--batch 64 --steps 8` checks that both modes agree).

Prints, per round of `--steps` steps, the median (and mean, which counts the garbage
collector's pauses and the route logs' folds) host milliseconds per step and per sequence,
and the collections that ran in timed steps by generation (count, longest ms). With
`--gc-steps` (what the replica does since the twenty-fourth session) collections run after
a step, as the scheduler loop runs them (`rlsys.engine.gc_steps`), and a step's time
includes them; without, the interpreter's thresholds put them inside steps. With
`--breakdown`, one more round with wrappers on the host functions (their
inclusive time, device work taken out; the wrappers' own cost inflates it); with
`--profile N`, one more round under cProfile: the N functions with the most self time.

`--layout-contexts`: the layout's share alone at longer contexts than the interpreter can
reach (`StaticDecodeLayout.fill`, 64-token pages, a 512-token window, `--batch` sequences
in lockstep, which cross page boundaries in the same step): median and longest fill over
200 decode steps per context.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import gc
import os
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("RLSYS_KERNELS", "triton")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.engine_gc_pauses import Pauses  # noqa: E402
from rlsys.config.engine import EngineConfig  # noqa: E402
from rlsys.config.model import preset  # noqa: E402
from rlsys.config.sampling import SamplingConfig  # noqa: E402
from rlsys.engine import gc_steps  # noqa: E402
from rlsys.engine.api import GenerationRequest  # noqa: E402
from rlsys.engine.core import EngineCore  # noqa: E402
from rlsys.engine.decode_graphs import DecodeGraphs  # noqa: E402
from rlsys.engine.gc_freeze import freeze_startup_objects  # noqa: E402
from rlsys.engine.runner import LocalRunner  # noqa: E402

# the host work an overlapped decode step does, by where it sits (inclusive of callees)
BREAKDOWN: list[tuple[str, str]] = [
    ("rlsys.engine.core:EngineCore", "_launch_ahead"),
    ("rlsys.engine.decode_graphs:DecodeGraphs", "launch"),
    ("rlsys.model.decode_layout:StaticDecodeLayout", "fill"),
    ("rlsys.engine.decode_graphs:SamplingBuffers", "fill"),
    ("rlsys.engine.core:EngineCore", "_flush"),
    ("rlsys.engine.core:EngineCore", "_keep_route_rows"),
    ("rlsys.engine.core:EngineCore", "_write_records"),
    ("rlsys.engine.route_journal:RouteJournal", "close"),
    ("rlsys.engine.core:EngineCore", "_read_step"),
    ("rlsys.engine.decode_graphs:DecodeGraphs", "collect"),
    ("rlsys.engine.sampler:SampleOut", "unpack"),
    ("rlsys.engine.core:EngineCore", "_sample_ready"),
    ("rlsys.engine.core:EngineCore", "_emit"),
    ("rlsys.engine.sequence:Sequence", "stop_reason"),
]


class DeviceWork:
    """`DecodeGraphs._forward`, timed; replayed from its first steady result once armed."""

    def __init__(self, replay: bool) -> None:
        self.spent = 0.0
        self.replay, self.armed = replay, False
        self._kept: dict[int, Any] = {}
        raw = DecodeGraphs._forward

        def forward(graphs: DecodeGraphs, layout: Any, params: Any) -> Any:
            t0 = time.perf_counter()
            try:
                if self.armed and id(layout) in self._kept:
                    return self._kept[id(layout)]
                out = raw(graphs, layout, params)
                if self.armed and self.replay:
                    self._kept[id(layout)] = out
                return out
            finally:
                self.spent += time.perf_counter() - t0

        DecodeGraphs._forward = forward  # type: ignore[method-assign]


class Breakdown:
    """Inclusive wall time of the host functions in BREAKDOWN, device work taken out."""

    def __init__(self, device: DeviceWork) -> None:
        self.device = device
        self.host: dict[str, float] = {}

    def install(self) -> None:
        for where, name in BREAKDOWN:
            module, owner_name = where.split(":")
            owner = getattr(sys.modules[module], owner_name)
            self._wrap(owner, name)

    def _wrap(self, owner: type, name: str) -> None:
        raw = owner.__dict__[name]
        static = isinstance(raw, staticmethod)
        fn: Callable[..., Any] = raw.__func__ if static else raw
        label = f"{owner.__name__}.{name}"

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            device0, t0 = self.device.spent, time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.perf_counter() - t0 - (self.device.spent - device0)
                self.host[label] = self.host.get(label, 0.0) + spent

        setattr(owner, name, staticmethod(wrapper) if static else wrapper)


def loaded_graph_core(batch: int, prompt_len: int, gen: int) -> EngineCore:
    """A CPU `EngineCore` on decode graphs with overlap, holding `batch` requests."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    cfg = preset("tiny").with_overrides({"n_layers": 2, "swa_per_sparse": 1})
    ecfg = EngineConfig(
        max_running=batch, max_context_tokens=prompt_len + gen + 8, device="cpu",
        max_step_tokens=max(batch * prompt_len, 8192), prefix_cache_tokens=0,
        overlap_decode=True,
    )  # fmt: skip
    pages = batch * ((prompt_len + gen + 8) // 32 + 2)
    runner = LocalRunner(cfg, None, "cpu", kv_pages=pages, page_tokens=32)
    runner.enable_decode_graphs(batch, ecfg.max_context_tokens, candidates=ecfg.candidate_cap)
    core = EngineCore(cfg, ecfg, runner)
    vocab = min(cfg.vocab_size, 60)
    for i in range(batch):
        prompt = [(7 * j + i) % vocab for j in range(prompt_len)]
        params = SamplingConfig(max_tokens_per_turn=gen, top_p=0.95)
        assert core.add(GenerationRequest(f"r{i}", f"s{i}", prompt, params, seed=i)) is None
    return core


def steady_host_ms(core: EngineCore, device: DeviceWork, steps: int, batch: int) -> list[float]:
    """Host milliseconds of each of `steps` steady decode steps (with the collections
    `gc_steps` runs after each, when it took over)."""
    out = []
    for _ in range(steps):
        assert core._in_flight is not None and len(core.running) == batch, "raise the budget"
        device0, t0 = device.spent, time.perf_counter()
        core.step()
        gc_steps.after_step(idle=not core.has_work())
        out.append(1000 * (time.perf_counter() - t0 - (device.spent - device0)))
    return out


def print_profile(core: EngineCore, device: DeviceWork, steps: int, batch: int, top: int) -> None:
    """One more round under cProfile (the start-up and the interpreter's first step stay
    out of it: profiled, they take many minutes): the `top` functions by self time, per
    step. The replayed device work is one function here, near the top; its time is the
    lookup that returns the first step's outputs again."""
    profiler = cProfile.Profile()
    profiler.enable()
    steady_host_ms(core, device, steps, batch)
    profiler.disable()
    stats = pstats.Stats(profiler)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]  # type: ignore[attr-defined]
    print("| self ms per step | inclusive ms per step | calls per step | function |")
    print("|---:|---:|---:|---|")
    for (path, line, name), (_, calls, self_s, incl_s, _) in rows:
        where = f"{Path(path).name}:{line} {name}" if line else name
        print(
            f"| {1000 * self_s / steps:.3f} | {1000 * incl_s / steps:.3f} "
            f"| {calls / steps:.1f} | `{where}` |"
        )


def layout_fill_ms(batch: int, context: int, steps: int = 200) -> tuple[float, float]:
    """Median and longest `StaticDecodeLayout.fill` (ms) of `batch` sequences decoding in
    lockstep from `context - 100` tokens (64-token pages)."""
    from rlsys.model.decode_layout import StaticDecodeLayout, scratch_pages
    from rlsys.model.paged_cache import PagedSeqCache, PagePool

    cfg = preset("tiny").with_overrides(
        {"swa_window": 512, "sparse_block": 8, "sparse_query_tile": 16, "swa_tile": 16}
    )
    pages = batch * (context // 64 + 4) + 2
    pool = PagePool(cfg, page_size=64, sparse_pages=pages, swa_pages=pages,
                    dtype=torch.float32, device="cpu")  # fmt: skip
    layout = StaticDecodeLayout(cfg, pool, batch, context + steps, scratch_pages(pool))
    caches = [PagedSeqCache(length=context - 100) for _ in range(batch)]
    for cache in caches:
        pool.reserve(cache, cache.length)
        pool.trim_window(cache)
    tokens, spent = list(range(batch)), []
    for _ in range(steps):
        t0 = time.perf_counter()
        layout.fill(tokens, caches)
        spent.append(1000 * (time.perf_counter() - t0))
        layout.advance(caches)
    return statistics.median(spent[10:]), max(spent[10:])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device-work", choices=("replayed", "real"), default="replayed")
    parser.add_argument("--breakdown", action="store_true")
    parser.add_argument("--layout-contexts", default="")
    parser.add_argument("--profile", type=int, default=0, help="top functions of one round")
    parser.add_argument("--gc-steps", action="store_true", help="collect after steps")
    args = parser.parse_args()
    if args.layout_contexts:
        torch.set_num_threads(1)
        print("| batch | context | layout fill ms, median | longest |")
        print("|---:|---:|---:|---:|")
        for context in (int(c) for c in args.layout_contexts.split(",")):
            median, longest = layout_fill_ms(args.batch, context)
            print(f"| {args.batch} | {context} | {median:.3f} | {longest:.3f} |")
        return
    device = DeviceWork(replay=args.device_work == "replayed")
    rounds = args.rounds + (1 if args.breakdown else 0) + (1 if args.profile else 0)
    core = loaded_graph_core(args.batch, args.prompt, 2 + rounds * args.steps + 4)
    freeze_startup_objects()  # as the replica does once it is built (`gc_freeze`)
    if args.gc_steps:
        gc_steps.take_over()
    device.armed = True  # the first decode step's outputs are the ones replayed
    while core._in_flight is None or len(core.running) != args.batch:
        if len(core.running) + len(core.waiting) < args.batch:  # it would spin for ever
            raise SystemExit("a request ended before the batch decoded together; run again")
        core.step()  # prefill, first tokens: until one decode step is queued ahead
        gc_steps.after_step(idle=not core.has_work())  # as the scheduler loop collects
    medians, means = [], []
    pauses = Pauses()
    gc.callbacks.append(pauses)
    for r in range(args.rounds):
        ms = steady_host_ms(core, device, args.steps, args.batch)
        medians.append(statistics.median(ms))
        means.append(statistics.mean(ms))
        print(
            f"round {r + 1}: batch {args.batch}, {args.steps} steady decode steps, host "
            f"{medians[-1]:.2f} ms per step (mean {means[-1]:.2f}, min {min(ms):.2f}, max "
            f"{max(ms):.2f}), {1000 * medians[-1] / args.batch:.1f} us per sequence "
            f"({args.device_work} device work)"
        )
    gc.callbacks.remove(pauses)
    print(
        f"host ms per step, the rounds' medians: {', '.join(f'{m:.2f}' for m in medians)}; "
        f"means: {', '.join(f'{m:.2f}' for m in means)}; collections in timed steps "
        f"({'after steps' if args.gc_steps else 'automatic'}): "
        + ", ".join(
            f"gen {g} x{len(ps)} (longest {1000 * max(ps, default=0):.2f} ms)"
            for g, ps in pauses.by_gen.items()
        )
    )
    if args.profile:
        print_profile(core, device, args.steps, args.batch, args.profile)
    if args.breakdown:
        breakdown = Breakdown(device)
        breakdown.install()
        steady_host_ms(core, device, args.steps, args.batch)
        print("| host function (inclusive, device work out, wrapped) | ms per step |")
        print("|---|---:|")
        for label, s in sorted(breakdown.host.items(), key=lambda kv: -kv[1]):
            print(f"| `{label}` | {1000 * s / args.steps:.3f} |")


if __name__ == "__main__":
    main()
