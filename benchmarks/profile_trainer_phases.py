"""Where a trainer step's wall goes, phase by phase: host time beside the device's span.

Usage: python benchmarks/profile_trainer_phases.py [--preset large] [--layers 48]
    [--length 8192] [--graphs] [--device cuda]

`profile_trainer_gpu.py` says how busy the GPU is; this says which part of `train_step`
keeps the host from feeding it. Each phase (`_plan`, and per micro-batch the trunk, the LM
head's log-probs, the objective, the backward, the token sums; then `_update` and the
step's one read, `fill`) is wrapped: the host's time inside it (perf_counter) and, on
CUDA, the span between events recorded on the stream at its entry and exit. A phase whose
host time exceeds its device span is host-bound: the GPU ran out of queued work in it.
No synchronisation is added inside the step, so the timeline is the real one; the
wrappers cost a few microseconds per call. One warm-up step (compiles, captures graphs),
then `--repeat` measured steps; the table is the last step's.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import rlsys.trainer.trainer as trainer_module  # noqa: E402
from benchmarks.profile_trainer_gpu import profiled_trainer  # noqa: E402
from rlsys.trainer import Trainer  # noqa: E402
from rlsys.trainer.batch import PackedBatch  # noqa: E402
from rlsys.trainer.metrics import TokenSums  # noqa: E402


@dataclass
class Phase:
    """One phase's calls in a step: host seconds and the device events at its edges."""

    calls: int = 0
    host_s: float = 0.0
    events: list[tuple[Any, Any]] = field(default_factory=list)

    def device_s(self) -> float | None:
        if not self.events:
            return None
        return sum(a.elapsed_time(b) for a, b in self.events) / 1e3


class PhaseClock:
    """Wraps callables so each call adds to its named phase."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.phases: dict[str, Phase] = {}

    def reset(self) -> None:
        self.phases = {}

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            phase = self.phases.setdefault(name, Phase())
            start_event = end_event = None
            if self.cuda:
                start_event = torch.cuda.Event(enable_timing=True)
                start_event.record()
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                phase.host_s += time.perf_counter() - start
                phase.calls += 1
                if self.cuda:
                    end_event = torch.cuda.Event(enable_timing=True)
                    end_event.record()
                    phase.events.append((start_event, end_event))

        return timed


def instrument(trainer: Trainer, clock: PhaseClock) -> None:
    """Wrap the step's phases: trainer methods on the instance, the module's helpers by
    name (the trainer calls them through its module's globals)."""
    for method in ("_filter", "_plan", "_passes", "_update", "_token_weights"):
        setattr(trainer, method, clock.wrap(method, getattr(trainer, method)))
    for helper in ("packed_hidden", "policy_log_probs", "per_token_terms", "pack"):
        setattr(trainer_module, helper, clock.wrap(helper, getattr(trainer_module, helper)))
    trainer.parallel.backward = clock.wrap("backward", trainer.parallel.backward)
    trainer.parallel.clip = clock.wrap("_update: clip", trainer.parallel.clip)
    trainer.optimizer.step = clock.wrap("_update: optimizer.step", trainer.optimizer.step)
    trainer.optimizer.zero_grad = clock.wrap("zero_grad", trainer.optimizer.zero_grad)
    trainer.model.update_balance = clock.wrap("_update: balance", trainer.model.update_balance)
    trainer.parallel.reduce_step = clock.wrap("reduce_step", trainer.parallel.reduce_step)
    # on the classes: each step's batches and sums are new objects
    for cls, method, name in (
        (PackedBatch, "to", "batch.to (host to device)"),
        (TokenSums, "add", "sums.add"),
        (TokenSums, "fill", "sums.fill (the step's read)"),
    ):
        setattr(cls, method, clock.wrap(name, getattr(cls, method)))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="large")
    p.add_argument("--layers", type=int, default=0, help="cut the preset to N blocks (0: all)")
    p.add_argument("--length", type=int, default=8192)
    p.add_argument("--graphs", action="store_true", help="the trunk as CUDA graphs")
    p.add_argument("--device", default="cuda")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--runtime", action="store_true", help="then the CUDA runtime calls")
    args = p.parse_args()
    cuda = args.device == "cuda"
    trainer, trajs = profiled_trainer(
        args.preset, args.layers, args.length, args.graphs, args.device
    )
    clock = PhaseClock(cuda)
    instrument(trainer, clock)
    walls = []
    for _ in range(1 + args.repeat):
        clock.reset()
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        trainer.train_step(trajs)
        if cuda:
            torch.cuda.synchronize()
        walls.append(time.perf_counter() - start)
    blocks = len(trainer.model.blocks)  # type: ignore[attr-defined]
    print(f"{args.preset} ({blocks} blocks), 2 x {args.length} tokens, graphs "
          f"{'on' if args.graphs else 'off'}, {args.device}; step walls "
          + ", ".join(f"{w:.3f}" for w in walls) + " s (first: warm-up)")  # fmt: skip
    wall = walls[-1]
    print("\n| phase | calls | host ms | device span ms | host share of the step |")
    print("|---|---:|---:|---:|---:|")
    for name, phase in clock.phases.items():
        device = phase.device_s()
        device_ms = f"{device * 1e3:,.1f}" if device is not None else "-"
        print(f"| {name} | {phase.calls} | {phase.host_s * 1e3:,.1f} | {device_ms} | "
              f"{phase.host_s / wall:.0%} |")  # fmt: skip
    print(f"| (step wall) | 1 | {wall * 1e3:,.1f} | | |")
    if args.runtime and cuda:
        runtime_calls(trainer, trajs)


def runtime_calls(trainer: Trainer, trajs: list) -> None:
    """One more step under the profiler: the CUDA runtime and driver calls by host time.
    A long synchronize, free or malloc here is a wait the sync debug mode does not flag."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        trainer.train_step(trajs)
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.key.startswith(("cuda", "cu"))]
    rows.sort(key=lambda e: -e.self_cpu_time_total)
    print("\n| runtime call | calls | host ms | longest ms |")
    print("|---|---:|---:|---:|")
    for e in rows[:12]:
        longest = max((x.cpu_time_total for x in prof.events() if x.name == e.key), default=0)
        print(
            f"| {e.key} | {e.count} | {e.self_cpu_time_total / 1e3:,.1f} | {longest / 1e3:,.1f} |"
        )


if __name__ == "__main__":
    main()
