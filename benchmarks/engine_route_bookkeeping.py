"""Host time an engine step spends keeping its sequences' routes (CPU, the native engine).

Usage: python benchmarks/engine_route_bookkeeping.py [--batch 256] [--prompt 32] [--gen 128]

`--batch` requests of a `--prompt`-token prompt each generate `--gen` tokens through
`EngineCore` on the CPU (`tiny`, one thread). Wrappers time, over the decode steps (after
the first, the prefill), the three places a token's routes pass through on the host: the
route log's appends (`RouteLog.append_compact`: one part per sequence per step, and its
folds), the token records (`EngineCore._record`) and the results (`EngineCore._result`,
which cut a finished request's token routes). Prints one line: each one's and their sum's
milliseconds per decode step. On the GPU this host work overlaps the device's step only
while the step is longer: at a batch of 256 it is part of the gap between replays.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_gc_pauses import loaded_core  # noqa: E402
from rlsys.engine.core import EngineCore  # noqa: E402
from rlsys.engine.route_log import RouteLog  # noqa: E402

SPENT: dict[str, float] = {}


def timed(owner: type, name: str) -> None:
    """Replace `owner.name` by a wrapper adding its wall time to SPENT[name]."""
    raw = owner.__dict__[name]
    fn: Callable[..., Any] = raw.__func__ if isinstance(raw, staticmethod) else raw

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            SPENT[name] = SPENT.get(name, 0.0) + time.perf_counter() - t0

    setattr(owner, name, staticmethod(wrapper) if isinstance(raw, staticmethod) else wrapper)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--gen", type=int, default=128)
    args = parser.parse_args()
    for owner, name in ((RouteLog, "append_compact"), (EngineCore, "_record"),
                        (EngineCore, "_result")):  # fmt: skip
        timed(owner, name)
    core = loaded_core("tiny", args.batch, args.prompt, args.gen)
    core.step()  # the prefill
    SPENT.clear()
    steps = 0
    while core.has_work():
        core.step()
        steps += 1
    cells = ", ".join(f"{name} {1000 * s / steps:.3f}" for name, s in SPENT.items())
    total = 1000 * sum(SPENT.values()) / steps
    print(f"batch {args.batch}, {steps} decode steps: {cells}; all {total:.3f} ms per step")


if __name__ == "__main__":
    main()
