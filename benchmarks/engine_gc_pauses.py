"""Python garbage-collection pauses inside engine steps (CPU, the native engine).

Usage: python benchmarks/engine_gc_pauses.py [--preset tiny] [--batch 32] [--prompt 64]
    [--gen 512] [--freeze]

`--batch` requests of a `--prompt`-token prompt each generate `--gen` tokens through
`EngineCore` on the CPU (one thread); `gc.callbacks` time every collection. A collection of
the oldest generation walks every object the process tracks, so its pause grows with the
objects alive: the start-up's (modules, the model) and the engine's per-token records. With
`--freeze`, `gc.freeze()` after the engine is built moves the start-up's objects out of
every later collection (what a long-lived engine process can do once it is ready). Prints
one table row: collections and their longest and total pause per generation, objects
tracked after start-up, at their peak (sampled every 64 steps) and at the end, and the
median and longest engine step.
A pause inside a step on the GPU host stalls the decode pipeline for as long (the steps
queued ahead run out), so this is a tail-latency question, not a throughput one.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlsys.config.engine import EngineConfig  # noqa: E402
from rlsys.config.model import preset  # noqa: E402
from rlsys.config.sampling import SamplingConfig  # noqa: E402
from rlsys.engine.api import GenerationRequest  # noqa: E402
from rlsys.engine.core import EngineCore  # noqa: E402
from rlsys.engine.gc_freeze import freeze_startup_objects  # noqa: E402
from rlsys.engine.runners import make_runner  # noqa: E402


class Pauses:
    """Every collection's generation and wall time while installed."""

    def __init__(self) -> None:
        self.by_gen: dict[int, list[float]] = {0: [], 1: [], 2: []}
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.by_gen[info["generation"]].append(time.perf_counter() - self._t0)

    def total(self) -> float:
        """Seconds paused in every collection so far."""
        return sum(sum(ps) for ps in self.by_gen.values())


def loaded_core(name: str, batch: int, prompt_len: int, gen: int) -> EngineCore:
    """A CPU `EngineCore` of preset `name` (one thread, random weights) holding `batch`
    requests of a `prompt_len`-token prompt that each generate `gen` tokens."""
    torch.set_num_threads(1)
    cfg = preset(name)
    ecfg = EngineConfig(
        max_running=batch, max_context_tokens=prompt_len + gen + 8, device="cpu",
        max_step_tokens=max(batch, 8192), prefix_cache_tokens=0,
    )  # fmt: skip
    core = EngineCore(cfg, ecfg, make_runner(cfg, ecfg, None))
    vocab = min(cfg.vocab_size, 60)
    for i in range(batch):
        prompt = [(7 * j + i) % vocab for j in range(prompt_len)]
        params = SamplingConfig(max_tokens_per_turn=gen)
        assert core.add(GenerationRequest(f"r{i}", f"s{i}", prompt, params, seed=i)) is None
    return core


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--gen", type=int, default=512)
    parser.add_argument("--freeze", action="store_true")
    args = parser.parse_args()
    core = loaded_core(args.preset, args.batch, args.prompt, args.gen)
    if args.freeze:
        freeze_startup_objects()
    start_objects = len(gc.get_objects())
    pauses = Pauses()
    gc.callbacks.append(pauses)
    steps = []
    peak = start_objects  # tracked objects, sampled every 64 steps (outside the timing)
    while core.has_work():
        t0 = time.perf_counter()
        core.step()
        steps.append(time.perf_counter() - t0)
        if len(steps) % 64 == 0:
            peak = max(peak, len(gc.get_objects()))
    gc.callbacks.remove(pauses)
    steps.sort()
    cells = []
    for gen in (0, 1, 2):
        ps = pauses.by_gen[gen]
        cells.append(f"{len(ps)} / {1000 * max(ps, default=0):.1f} / {1000 * sum(ps):.1f}")
    print(f"| {args.preset} | {args.batch} x {args.gen} | {'yes' if args.freeze else 'no'} | "
          + " | ".join(cells) + f" | {start_objects:,} | {peak:,} | {len(gc.get_objects()):,} "
          f"| {1000 * steps[len(steps) // 2]:.1f} / {1000 * steps[-1]:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
