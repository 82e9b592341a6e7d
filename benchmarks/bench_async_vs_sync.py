"""Async against sync: wall time per 1,000 trained samples, and the staleness paid for it.

One job config, run twice on local Ray: `rollout.pipeline=async` (generation keeps going
while the trainer steps; samples may be up to `algo.max_staleness` versions old) and
`rollout.pipeline=sync` (generate one step's groups, train, publish the weights, repeat;
staleness 0). Rollout durations are long-tailed, as agentic ones are: the scaffold's
simulated environment latency (`rollout.scaffold.tool_latency`, lognormal) delays every
observation, deterministically per rollout id and turn.

Everything else is the real job: engine replicas, admission, rollout workers, sandboxes,
ledger (SQLite in a temporary directory), in-memory stream and trainer actor. The zero-
variance filter is off so every consumed sample is trained (the figure is a pipeline
figure, not a learning one).

Usage:
  .venv/bin/python benchmarks/bench_async_vs_sync.py [--samples 1000] [--median-s 0.5]
      [--sigma 1.5] [--config configs/bench-pipeline.yaml] [--set key=value ...]
      [--write benchmarks/results/job_pipeline.md]
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from rlsys.actors.job import run_job
from rlsys.actors.runtime import shutdown_ray
from rlsys.cli.job_config import load_job_config

ROOT = Path(__file__).resolve().parents[1]


def run_mode(args: argparse.Namespace, mode: str, run_root: str) -> dict[str, Any]:
    base = load_job_config(args.config, ())
    per_step = base.trainer.groups_per_step * base.rollout.group_size
    steps = math.ceil(args.samples / per_step)
    sets = (
        f"rollout.pipeline={mode}",
        f"trainer.steps={steps}",
        f"store.run_root={run_root}/{mode}",
        f"rollout.scaffold.tool_latency.median_s={args.median_s}",
        f"rollout.scaffold.tool_latency.sigma={args.sigma}",
        "algo.filter_zero_variance=false",
        *args.set,
    )
    cfg = load_job_config(args.config, sets)
    started = time.time()
    summary = run_job(cfg, on_event=lambda s: None)
    total_s = time.time() - started
    steps_m = summary["steps"]
    trained = summary["terminal"]["trained"]
    stale_means = [m.get("staleness", {}).get("mean", 0.0) for m in steps_m]
    stale_max = max((m.get("staleness", {}).get("max", 0) for m in steps_m), default=0)
    return {
        "mode": mode,
        "status": summary["status"],
        "steps": len(steps_m),
        "trained": trained,
        "loop_s": summary["wall_s"],
        "total_s": total_s,
        "s_per_1k": summary["wall_s"] / max(trained, 1) * 1000,
        "staleness_mean": statistics.fmean(stale_means) if stale_means else 0.0,
        "staleness_max": stale_max,
        "stale_filtered": summary["stale_filtered"],
        "drop_rate": summary.get("drop_rate", 0.0),
        "lost": summary.get("lost", 0),
    }


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| pipeline | steps | trained samples | loop wall s | s per 1,000 trained | "
        "staleness mean | staleness max | filtered_stale | drop_rate | lost |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    lines = [
        f"| {r['mode']} | {r['steps']} | {r['trained']} | {r['loop_s']:.0f} | "
        f"{r['s_per_1k']:.0f} | {r['staleness_mean']:.2f} | {r['staleness_max']} | "
        f"{r['stale_filtered']} | {r['drop_rate']:.4f} | {r['lost']} |"
        for r in rows
    ]
    return "\n".join([head, *lines])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "bench-pipeline.yaml"))
    p.add_argument("--samples", type=int, default=1000, help="trained samples per pipeline")
    p.add_argument("--median-s", type=float, default=0.5, help="median environment delay")
    p.add_argument("--sigma", type=float, default=1.5, help="lognormal shape of the delay")
    p.add_argument("--modes", default="async,sync")
    p.add_argument("--set", action="append", default=[], help="extra config override")
    p.add_argument("--write", default=None, help="also write the table to this markdown file")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="rlsys-bench-pipeline-") as run_root:
        try:
            for mode in args.modes.split(","):
                rows.append(run_mode(args, mode, run_root))
                print(table(rows[-1:]).splitlines()[-1], flush=True)
        finally:
            shutdown_ray()
    out = table(rows)
    by = {r["mode"]: r for r in rows}
    if "async" in by and "sync" in by:
        speedup = by["sync"]["s_per_1k"] / by["async"]["s_per_1k"]
        out += f"\n\nasync speed-up (sync s per 1,000 / async s per 1,000): **{speedup:.2f}x**"
    print(out)
    if args.write:
        Path(args.write).write_text(out + "\n")


if __name__ == "__main__":
    main()
