"""The learning check: on the quickstart's tool-use task, with trajectories the real engine
generates, RL raises the mean reward of a held-out evaluation, and the RL steps use the
zero-center projection (the job's default).

It runs `benchmarks/learn_arithmetic.py` (no Ray, staleness 0), in a process of its own that
starts when the session's tests are collected and overlaps with the rest of the suite
(tests/trainer/conftest.py): one supervised warm start on demonstrations from a slipping
demonstrator (30% of them forget the addend or use the wrong operator), then 12 RL steps
of 8 groups x 4 rollouts at lr 2e-4, evaluated on 128 held-out instances before and after.
The evaluation is paired: the same instances, each rollout sampled with its own seed, so
with unchanged weights "after" equals "before" and only a real change of the policy can
pass.

The MTP heads are off here (`--mtp-weight 0`): their loss trains the heads alone (the trunk,
embedding and LM head enter it detached, and their gradient is clipped apart), and this
loop's engine does not draft, so the policy learns exactly what it learns with them on, for
less compute.

The arm without the projection that this test used to run as well is gone: in fp32 on
this task the two arms ended alike (0.805 both), so it could not fail for the projection's
sake and cost a third of the test's time; what the projection buys is measured where low
precision breaks the zero-sum logit gradient (BENCHMARKS.md, "Zero-center projection in
bf16"), and `learn_arithmetic.py --zero-center off` still runs that arm by hand.

Why a slipping demonstrator: an oracle-only warm start leaves RL a headroom that depends on
where a fixed number of Adam steps happens to land, and that moved with the CPU (the same
code evaluated 0.67 on one 2-core machine and 0.89, leaving nothing to learn, on another).
Mistakes in the demonstrations bound the warm-started policy below 1 on any machine, and
the learning-rate decay at the end of the warm start settles it there.

Not bitwise reproducible run to run: the engine samples from per-request seeded generators,
but CPU training's threaded backward reductions vary in the last bits, so two runs of the
same code on the 2-core box gave 0.625 -> 0.859 and 0.586 -> 0.805 (with the projection);
the bounds leave room for that and for another CPU's rounding. It runs on one thread: the
suite beside it keeps the other core (with two threads it took 1.2 cores, starved the
suite, and ended 0.492 -> 0.570 in one loaded CI run; one thread, as loaded: 0.539 -> 0.820).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.trainer.conftest import learning_result

pytestmark = [pytest.mark.learning, pytest.mark.timeout(1800)]

HARNESS = Path(__file__).resolve().parents[2] / "benchmarks" / "learn_arithmetic.py"
ARGS = [
    "--warm-steps", "120", "--slip-rate", "0.3", "--content-weight", "1.0",
    "--steps", "12", "--groups", "8", "--group-size", "4", "--lr", "2e-4", "--warmup", "5",
    "--eval", "128", "--mtp-weight", "0", "--threads", "1",
]  # fmt: skip


def _harness() -> ModuleType:
    spec = importlib.util.spec_from_file_location("learn_arithmetic", HARNESS)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve annotations through it
    spec.loader.exec_module(module)
    return module


def harness_command(result: Path) -> list[str]:
    """The learning run as a command that writes its result (JSON) to `result`."""
    return [sys.executable, str(HARNESS), *ARGS, "--json", str(result)]


@pytest.fixture(scope="module")
def runs() -> dict[str, dict]:
    background = learning_result()
    if background is not None:
        return {"on": background}
    harness = _harness()
    args = harness.parser().parse_args(ARGS)
    warm = harness.warm_start(args)
    return {"on": harness.reinforce(args, warm, "on")}


def test_the_warm_start_leaves_rl_headroom(runs: dict[str, dict]) -> None:
    before = runs["on"]["before"]
    assert 0.15 <= before <= 0.85, before


def test_rl_raises_the_held_out_reward(runs: dict[str, dict]) -> None:
    r = runs["on"]
    assert r["after"] >= r["before"] + 0.08, r
