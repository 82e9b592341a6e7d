"""Where a test run's CPU went: a log of `RLSYS_TEST_CPU_LOG` as a table per test folder.

The 2-core CI box is CPU-bound, so the suite's wall time follows its CPU seconds, and the
cores column says which folders wait (under 1: one core idle) and which fill the box.

Usage:
  RLSYS_TEST_CPU_LOG=/tmp/cpu.tsv make test     (or CI=true bash .ci/run)
  python benchmarks/suite_cpu_table.py /tmp/cpu.tsv [--top 15]

Prints, for each session in the log (CI's two suites append one each): per folder its
tests, wall seconds, CPU seconds and mean busy cores, then the costliest tests.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class Session:
    header: list[str] = field(default_factory=list)
    rows: list[tuple[float, float, str]] = field(default_factory=list)  # cpu, wall, test


def read_sessions(path: str) -> list[Session]:
    """The log's sessions: each starts with its invocation line ('# <args>')."""
    sessions: list[Session] = []
    for line in open(path):
        line = line.rstrip("\n")
        if line.startswith("# ") and not line.startswith("# cpu_s"):
            if not sessions or sessions[-1].rows:
                sessions.append(Session())
            sessions[-1].header.append(line[2:])
        elif line and not line.startswith("#"):
            cpu, wall, _cores, test = line.split("\t", 3)
            sessions[-1].rows.append((float(cpu), float(wall), test))
    return sessions


def folder(test: str) -> str:
    parts = test.split("::")[0].split("/")
    return parts[1] if len(parts) > 2 else parts[-1]


def print_session(session: Session, top: int) -> None:
    for line in session.header:
        print(f"# {line}")
    by_folder: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for cpu, wall, test in session.rows:
        acc = by_folder[folder(test)]
        acc[0] += 1
        acc[1] += wall
        acc[2] += cpu
    print(f"| {'folder':<28} | tests | wall s | CPU s | cores |")
    print(f"|{'-' * 30}|------:|-------:|------:|------:|")
    for name, (n, wall, cpu) in sorted(by_folder.items(), key=lambda kv: -kv[1][2]):
        print(f"| {name:<28} | {n:5d} | {wall:6.0f} | {cpu:5.0f} | {cpu / max(wall, 1e-9):5.2f} |")
    print(f"\ncostliest {top} tests (CPU s, wall s):")
    for cpu, wall, test in sorted(session.rows, reverse=True)[:top]:
        print(f"  {cpu:6.1f} {wall:6.1f}  {test}")
    print()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("log")
    p.add_argument("--top", type=int, default=15)
    args = p.parse_args()
    for session in read_sessions(args.log):
        print_session(session, args.top)


if __name__ == "__main__":
    main()
