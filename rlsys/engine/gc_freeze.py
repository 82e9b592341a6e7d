"""Garbage collection in a long-lived engine process: the start-up's objects frozen.

A collection of the oldest generation walks every object the process tracks. An engine
process holds a few hundred thousand from its start-up (modules, the model's modules and
parameters, the runner's buffers and captured graphs) that live as long as the process, so
every full collection walks them again, inside an engine step: on the GPU such a pause
stalls the decode steps queued behind the host. `freeze_startup_objects`, called once the
engine is built, moves them to the permanent generation, out of every later collection
(`benchmarks/engine_gc_pauses.py`: a full collection's pause 107-141 ms -> 31-51 ms on the
CPU engine). Collections still run and still free the run's own cycles.

Invariant: only a process that owns its engine for its whole life calls this, once, at
start-up: a frozen object is never collected, so a cycle among start-up objects that later
becomes garbage stays (the engine keeps its start-up objects anyway).
"""

from __future__ import annotations

import gc


def freeze_startup_objects() -> int:
    """Collect what start-up left behind, then freeze every object alive; returns how many
    objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
