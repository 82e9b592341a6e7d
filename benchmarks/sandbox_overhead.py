"""Per-command overhead of each sandbox backend: `true` and `python3 -c pass`, median wall.

Usage: .venv/bin/python benchmarks/sandbox_overhead.py [--repeat 20] [--backends bwrap,process]
"""

from __future__ import annotations

import argparse
import statistics
import warnings

from rlsys.sandboxes.base import SandboxError
from rlsys.sandboxes.registry import open_sandbox, parse_sandbox_config


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--backends", default="process,bwrap,docker")
    args = parser.parse_args()
    print(f"{'backend':<8} {'command':<18} {'median_ms':>10} {'p90_ms':>8}")
    for backend in args.backends.split(","):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                box = open_sandbox(parse_sandbox_config({"type": backend}))
            except SandboxError as err:
                print(f"{backend:<8} unavailable: {err}")
                continue
        with box:
            for command in (["true"], ["python3", "-c", "pass"]):
                walls = sorted(box.run(command).wall_s * 1e3 for _ in range(args.repeat))
                p90 = walls[int(0.9 * (len(walls) - 1))]
                name = " ".join(command)
                print(f"{backend:<8} {name:<18} {statistics.median(walls):>10.1f} {p90:>8.1f}")


if __name__ == "__main__":
    main()
