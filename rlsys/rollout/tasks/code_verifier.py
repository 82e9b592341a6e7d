"""The code task's verifier: hidden unit tests, run in a fresh sandbox after the episode.

Why it cannot be short-circuited from the episode:
- It runs in a new sandbox holding only the submitted `solution.py` and the runner; nothing
  else the agent wrote (conftest.py, sitecustomize.py, edited tests) comes along, and
  `python3 -I` ignores PYTHON* variables, user site and the script's folder.
- The hidden cases and a random nonce arrive on stdin and are never on disk. Each case's
  result is reported as `<nonce> <index> pass|fail` on a duplicate of fd 1 taken before the
  solution is imported. Only nonce-tagged lines count, exit codes are ignored: sys.exit(0)
  or os._exit(0) at import ends the run with nothing passed.
- Results are compared as canonical JSON, so an object with a rigged `__eq__` fails; each
  case has its own time limit (SIGALRM), so one infinite loop fails one case.

Reward (documented choice): `fraction` = passed / total (default, a denser signal), or
`pass_fail` = 1.0 only when every hidden case passes. A verifier run killed by the wall
limit still counts the cases it reported (the rest failed); a broken sandbox raises
`RolloutAbort("failed_sandbox")`.
"""

from __future__ import annotations

import json
import secrets
from typing import Any, Literal

from rlsys.rollout.failures import RolloutAbort, describe
from rlsys.rollout.tasks.base import SandboxFactory, Verdict
from rlsys.sandboxes.base import SandboxError

RewardMode = Literal["fraction", "pass_fail"]
RUNNER_FILE = "_verify.py"
SOLUTION_FILE = "solution.py"

RUNNER = r"""
import importlib.util, json, os, signal, sys

def main():
    spec = json.loads(sys.stdin.readline())
    nonce, cases, limit = spec["nonce"], spec["cases"], spec["per_case_s"]
    out = os.dup(1)

    def report(i, ok):
        os.write(out, ("%s %d %s\n" % (nonce, i, "pass" if ok else "fail")).encode())

    def on_alarm(signum, frame):
        raise TimeoutError("case time limit")

    signal.signal(signal.SIGALRM, on_alarm)
    try:
        signal.setitimer(signal.ITIMER_REAL, limit)
        mod_spec = importlib.util.spec_from_file_location("solution", "solution.py")
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
        signal.setitimer(signal.ITIMER_REAL, 0)
        fn = getattr(module, spec["function"])
    except BaseException:
        for i in range(len(cases)):
            report(i, False)
        return
    for i, (args, expected) in enumerate(cases):
        try:
            signal.setitimer(signal.ITIMER_REAL, limit)
            got = fn(*args)
            signal.setitimer(signal.ITIMER_REAL, 0)
            ok = json.dumps(got, sort_keys=True) == json.dumps(expected, sort_keys=True)
        except BaseException:
            signal.setitimer(signal.ITIMER_REAL, 0)
            ok = False
        report(i, ok)

main()
"""


def verify_solution(
    source: bytes,
    function: str,
    cases: list[tuple[list[Any], Any]],
    open_sandbox: SandboxFactory,
    *,
    per_case_s: float = 2.0,
    reward_mode: RewardMode = "fraction",
) -> Verdict:
    """Run `cases` against `source` in a fresh sandbox; the verdict counts passed cases."""
    nonce = secrets.token_hex(16)
    spec = {"nonce": nonce, "cases": cases, "per_case_s": per_case_s, "function": function}
    try:
        with open_sandbox() as sandbox:
            sandbox.write_file(SOLUTION_FILE, source)
            sandbox.write_file(RUNNER_FILE, RUNNER)
            result = sandbox.run(
                ["python3", "-I", RUNNER_FILE],
                stdin=(json.dumps(spec) + "\n").encode(),
                timeout_s=per_case_s * (len(cases) + 1) + 10.0,
            )
    except SandboxError as err:
        raise RolloutAbort("failed_sandbox", describe(err)) from err
    passed = _passed_cases(result.stdout_text, nonce, len(cases))
    total = len(cases)
    if reward_mode == "fraction":
        reward = len(passed) / total
    else:
        reward = 1.0 if len(passed) == total else 0.0
    details = {
        "passed": len(passed),
        "total": total,
        "reward_mode": reward_mode,
        "exit_code": result.exit_code,
        "killed_reason": result.killed_reason,
    }
    return Verdict(reward, details)


def _passed_cases(stdout: str, nonce: str, total: int) -> set[int]:
    """Indices reported as passed; the first report of an index wins."""
    seen: dict[int, bool] = {}
    for line in stdout.splitlines():
        parts = line.split(" ")
        if len(parts) != 3 or parts[0] != nonce or not parts[1].isdigit():
            continue
        index = int(parts[1])
        if 0 <= index < total and index not in seen:
            seen[index] = parts[2] == "pass"
    return {i for i, ok in seen.items() if ok}
