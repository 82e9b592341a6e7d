"""Garbage collections at the engine's step boundary, never inside a step.

Python collects when a thread's allocations pass a threshold, in whichever thread and at
whichever line that happens. An engine at batch 256 allocates enough per step (records,
sampled tokens) to trigger a collection every other step, and a collection of the oldest
generation walks every object the run holds: on the H100 host, `medium` at batch 256 had
a collection in 65 of 97 timed decode steps, the longest 27 ms, against a 2.8 ms GPU step
(`bench_engine_gpu.py`, twenty-fourth session). A pause inside a step stalls the decode
steps queued behind the host.

A process that owns its engine for life (the replica) calls `take_over` once: automatic
collection is off, and the scheduler loop calls `after_step` after each step, when the
step just queued runs on the device:
- the youngest generation when more than `young` tracked objects were allocated since its
  last collection (the interpreter's own threshold, 700, moved to a chosen moment);
- generation 1 at every `middle`-th young collection (the interpreter's ratio, 10);
- the oldest only when the engine has no work left (after a busy stretch, or while it
  idles and commands allocate past `young`: the loop asks after each command batch too),
  or once `full_every` generation-1 collections passed without one while it stayed busy (a
  bound on what uncollected cycles can hold; the interpreter's own rule would run it
  inside a busy stretch).

Invariants: every reference cycle is still collected, at the latest when the engine idles
or after `full_every` middle collections; reference counting frees everything else at
once, as always. `give_back` restores the interpreter's automatic collection (tests;
a process that stops serving). Without `take_over`, `after_step` does nothing, so an
engine inside a process that does not own it (tests, a driver) leaves collection alone.
"""

from __future__ import annotations

import gc
import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class CollectionPolicy:
    """When `after_step` collects (module doc)."""

    young: int = 700
    middle: int = 10
    full_every: int = 100

    def __post_init__(self) -> None:
        if self.young < 0 or self.middle < 1 or self.full_every < 1:
            raise ValueError(
                f"collection policy needs young >= 0, middle >= 1, full_every >= 1: {self}"
            )


class _StepCollector:
    def __init__(self) -> None:
        self.policy: CollectionPolicy | None = None
        self.was_enabled = True
        self.young_runs = 0  # young collections since the last middle one
        self.middle_runs = 0  # middle collections since the last full one
        self.lock = threading.Lock()

    def after_step(self, idle: bool) -> int | None:
        policy = self.policy
        if policy is None:
            return None
        with self.lock:  # one collection at a time, if two engines share the process
            young = gc.get_count()[0]
            if idle:  # after a busy stretch, or past the young threshold while idle
                if young > policy.young or self.young_runs or self.middle_runs:
                    gc.collect(2)
                    self.young_runs = self.middle_runs = 0
                    return 2
                return None
            if young <= policy.young:
                return None
            self.young_runs += 1
            if self.young_runs < policy.middle:
                gc.collect(0)
                return 0
            self.young_runs = 0
            self.middle_runs += 1
            if self.middle_runs < policy.full_every:
                gc.collect(1)
                return 1
            self.middle_runs = 0
            gc.collect(2)
            return 2


_COLLECTOR = _StepCollector()


def take_over(policy: CollectionPolicy | None = None) -> None:
    """Turn the interpreter's automatic collection off in this process; from now on the
    engine's scheduler collects at its step boundaries (`after_step`)."""
    with _COLLECTOR.lock:
        if _COLLECTOR.policy is None:
            _COLLECTOR.was_enabled = gc.isenabled()
        _COLLECTOR.policy = policy or CollectionPolicy()
        _COLLECTOR.young_runs = _COLLECTOR.middle_runs = 0
        gc.disable()


def give_back() -> None:
    """Automatic collection as it was before `take_over`; `after_step` does nothing again."""
    with _COLLECTOR.lock:
        if _COLLECTOR.policy is None:
            return
        _COLLECTOR.policy = None
        if _COLLECTOR.was_enabled:
            gc.enable()


def after_step(idle: bool) -> int | None:
    """Collect what the policy asks for after an engine step (`idle`: the engine has no work
    left). Returns the generation collected, or None. A no-op unless `take_over` ran."""
    return _COLLECTOR.after_step(idle)
