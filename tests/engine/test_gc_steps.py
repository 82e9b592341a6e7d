"""An engine process that took over garbage collection collects after a step, never inside
one, and still frees every cycle a step left (`rlsys.engine.gc_steps`). Run in a child
process, so this test process's own collector is left as it was.

Each engine step also leaves `CYCLES` reference cycles of its own (more than the
interpreter's young threshold): with automatic collection, a collection then runs inside
that step, which the first assertion catches (the test fails without `take_over`: tried).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from rlsys.engine.gc_steps import CollectionPolicy

CHILD = textwrap.dedent(
    """
    import gc, sys, threading, time, weakref
    from rlsys.config.engine import EngineConfig
    from rlsys.engine import gc_steps
    from rlsys.engine.engine import InferenceEngine
    from tests.engine.conftest import prompts, request, tiny

    CYCLES = 1000

    class Cycle:
        pass

    cfg, model = tiny()
    engine = InferenceEngine(cfg, EngineConfig(max_context_tokens=256), model.state_dict())
    if sys.argv[1] == "take-over":
        # small thresholds, so a short run reaches every generation while busy
        gc_steps.take_over(gc_steps.CollectionPolicy(young=200, middle=3, full_every=4))
    inside = threading.Event()
    seen = []  # (generation, collected inside a step)
    kept = []  # a weak reference to one cycle of each step
    step = engine.core.step

    def step_with_cycles():
        inside.set()
        try:
            for _ in range(CYCLES):
                a, b = Cycle(), Cycle()
                a.other, b.other = b, a
            kept.append(weakref.ref(a))
            del a, b
            return step()
        finally:
            inside.clear()

    def on_collection(phase, info):
        if phase == "start":
            seen.append((info["generation"], inside.is_set()))

    engine.core.step = step_with_cycles
    gc.callbacks.append(on_collection)
    results = [engine.submit(request(f"r{i}", p, max_tokens=24)) for i, p in enumerate(prompts(4))]
    assert all(f.result(timeout=300).finish_reason == "length" for f in results)
    # the collection when the engine idles runs after the last step's results are handed out
    deadline = time.monotonic() + 60
    while any(ref() is not None for ref in kept) and time.monotonic() < deadline:
        time.sleep(0.01)
    gc.callbacks.remove(on_collection)
    engine.close()
    within = [g for g, inner in seen if inner]
    assert not within, f"collections inside a step: {len(within)} of {len(seen)}"
    assert {g for g, _ in seen} == {0, 1, 2}, seen  # every generation, all at step boundaries
    assert all(ref() is None for ref in kept), "a step's cycles outlived the idle collection"
    assert not gc.isenabled()
    gc_steps.give_back()
    assert gc.isenabled()
    print("ok", len(kept), len(seen))
    """
)


def _child(mode: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=600,
        check=False,
    )  # fmt: skip


def test_collections_run_at_step_boundaries_and_free_every_cycle() -> None:
    done = _child("take-over")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("ok")


def test_without_take_over_collections_land_inside_steps() -> None:
    """The check above can see a collection inside a step: the interpreter's own thresholds
    put one there (so the first test fails without `take_over`)."""
    done = _child("automatic")
    assert done.returncode != 0
    assert "collections inside a step" in done.stderr, done.stderr[-3000:]


def test_a_policy_out_of_range_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="middle >= 1"):
        CollectionPolicy(middle=0)
