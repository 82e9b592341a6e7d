"""Where the suite's CPU goes: per test, its wall time and the machine's busy CPU seconds.

On the 2-core CI box the suite is CPU-bound (both cores busy nearly all the run), so a
test's cost is the CPU it burns, not its wall time: a test that waits costs little, one
whose Ray actors import torch in five processes costs a lot. Wall time (`--durations`)
cannot tell them apart; this can. With `RLSYS_TEST_CPU_LOG=PATH` set, each test's call
phase and its fixtures' set-up and tear-down are charged the machine-wide busy jiffies of
`/proc/stat` (user + nice + system + irq + softirq) while they ran, and the table, most
expensive first, is appended to PATH at the end of the session (CI's two suites each add
one).

Invariant: machine-wide, so what runs beside a test (the learning check's background
process, tests/trainer/conftest.py, about one core while it lives) is charged to it too;
read the table's ranks, not its absolute seconds, for tests that ran in the learning
run's first minutes. Off (no hooks do any work) unless the variable is set.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from collections.abc import Iterator

import pytest

LOG = os.environ.get("RLSYS_TEST_CPU_LOG")
TICKS = os.sysconf("SC_CLK_TCK")
_COST: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])  # nodeid -> [wall s, cpu s]


def busy_cpu_seconds() -> float:
    """The machine's busy CPU seconds since boot, all cores."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq = fields[:7]
    return (user + nice + system + irq + softirq) / TICKS


def _charged(item: pytest.Item) -> Iterator[None]:
    wall, cpu = time.monotonic(), busy_cpu_seconds()
    yield
    cost = _COST[item.nodeid]
    cost[0] += time.monotonic() - wall
    cost[1] += busy_cpu_seconds() - cpu


if LOG:

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
        yield from _charged(item)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
        yield from _charged(item)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
        yield from _charged(item)

    def pytest_sessionfinish(session: pytest.Session) -> None:
        rows = sorted(_COST.items(), key=lambda kv: -kv[1][1])
        total_wall = sum(w for w, _ in _COST.values())
        total_cpu = sum(c for _, c in _COST.values())
        with open(LOG, "a") as f:
            f.write(f"# {' '.join(session.config.invocation_params.args)}\n")
            f.write(f"# {len(rows)} tests: {total_wall:.0f} s wall, {total_cpu:.0f} CPU s\n")
            f.write("# cpu_s\twall_s\tcores\ttest\n")
            for nodeid, (wall, cpu) in rows:
                f.write(f"{cpu:.1f}\t{wall:.1f}\t{cpu / max(wall, 1e-9):.2f}\t{nodeid}\n")
