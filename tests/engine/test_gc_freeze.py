"""An engine process freezes its start-up objects: later full collections walk only what the
run allocated, and still free the run's cycles (`rlsys.engine.gc_freeze`). Run in a child
process, so this test process's own collector is left as it was."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CHILD = textwrap.dedent(
    """
    import gc
    from rlsys.engine.gc_freeze import freeze_startup_objects
    from tests.engine.conftest import make_core, prompts, request, run_all, tiny

    cfg, model = tiny()
    core = make_core(cfg, model)
    alive = len(gc.get_objects())
    frozen = freeze_startup_objects()
    assert frozen >= alive - 100, (frozen, alive)  # everything alive at start-up
    walked = len(gc.get_objects())  # what a full collection walks now (frozen excluded)
    assert walked < frozen // 20, (walked, frozen)

    results = run_all(core, [request(f"r{i}", p) for i, p in enumerate(prompts(4))])
    assert all(r.finish_reason in ("length", "stop") for r in results.values())

    class Cycle:
        pass

    a, b = Cycle(), Cycle()
    a.other, b.other = b, a
    del a, b
    assert gc.collect() >= 2  # the run's own cycles are still collected
    assert gc.get_freeze_count() > frozen // 2  # still frozen: collections skip them
    print("ok", frozen, walked)
    """
)


def test_start_up_objects_are_frozen_and_cycles_still_collected() -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("ok")
