"""Whether a job's actors can be placed on the Ray cluster, checked before any of them starts.

A Ray actor that asks for more than any node offers (a GPU on a CPU-only cluster, a custom
resource no node declares) is not an error to Ray: it waits in PENDING_CREATION and Ray
logs "infeasible" somewhere the user may never look. The driver waits for its actors to be
ready, so such a job would sit in `actors` with a live heartbeat forever. This module states
what the job asks for (`job_demands`, from the config fields that ask) and finds what no
placement could satisfy (`unplaceable`), so the job ends `failed` with a line naming the
field instead.

Invariants:
- `unplaceable` checks two necessary conditions only: each actor fits on one node by
  itself, and the cluster's totals cover all the actors together. A job it passes may still
  not fit (packing is not checked); a job it refuses cannot fit as the cluster stands.
- It never refuses for lack of `memory` or `object_store_memory` (Ray defaults those); the
  resources asked are the ones the config names: CPU, GPU and custom resources.
- A cluster the driver started itself (a local run) cannot grow, so a refusal there ends
  the job; a joined cluster may have an autoscaler that adds nodes, so there the reasons are
  announced and the job goes on (`check_placement`).
- Whatever the check said, the driver's wait for its actors to be ready is bounded
  (`wait_ready`, `store.start_timeout_s`): an actor still not ready then ends the job
  `failed` with the pending actors named, and the caller kills every actor it started.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlsys.config.job import JobConfig
from rlsys.control.job_end import JobEnd

Resources = Mapping[str, float]
_EPS = 1e-9  # Ray's resource arithmetic is fixed-point at 1e-4; fractions add up inexactly


@dataclass(frozen=True)
class Demand:
    """`count` actors of one role, each asking for `resources`; `fields` names the config
    keys that set them (what a refusal tells the user to change)."""

    role: str
    count: int
    resources: dict[str, float]
    fields: str


def _asks(num_cpus: float, num_gpus: float, custom: Mapping[str, float]) -> dict[str, float]:
    asked = {"CPU": num_cpus, "GPU": num_gpus, **custom}
    return {name: amount for name, amount in asked.items() if amount > 0}


def job_demands(cfg: JobConfig) -> list[Demand]:
    """What `actors.job` starts: the trainer (and its data-parallel followers), the engine
    replicas and the rollout workers; the admission scheduler asks for nothing."""
    trainer, placement, rollout = cfg.trainer, cfg.engine.placement, cfg.rollout
    return [
        Demand(
            "trainer rank",
            trainer.data_parallel,
            _asks(trainer.num_cpus, trainer.num_gpus, trainer.resources),
            "trainer.num_cpus / num_gpus / resources (x trainer.data_parallel)",
        ),
        Demand(
            "engine replica",
            placement.replicas,
            _asks(placement.num_cpus, placement.num_gpus, placement.resources),
            "engine.placement.num_cpus / num_gpus / resources (x engine.placement.replicas)",
        ),
        Demand(
            "rollout worker",
            rollout.workers,
            _asks(rollout.num_cpus, 0.0, rollout.resources),
            "rollout.num_cpus / resources (x rollout.workers)",
        ),
    ]


def _fmt(resources: Resources) -> str:
    return ", ".join(f"{name} {amount:g}" for name, amount in sorted(resources.items())) or "none"


def unplaceable(demands: Sequence[Demand], nodes: Sequence[Resources]) -> list[str]:
    """Why `demands` cannot be placed on `nodes` (each node's total resources); [] when
    both necessary conditions hold (module doc)."""
    reasons = []
    for d in demands:
        if d.count and not any(
            all(node.get(name, 0.0) + _EPS >= amount for name, amount in d.resources.items())
            for node in nodes
        ):
            reasons.append(
                f"one {d.role} asks for {_fmt(d.resources)} and no node offers that much "
                f"({d.fields}); the largest node has {_fmt(_largest(nodes, d.resources))}"
            )
    names = sorted({name for d in demands for name in d.resources})
    for name, amount in ((name, total(demands, name)) for name in names):
        have = sum(node.get(name, 0.0) for node in nodes)
        if have + _EPS < amount:
            parts = " + ".join(
                f"{d.count} {d.role}(s) x {d.resources[name]:g}"
                for d in demands
                if d.count and name in d.resources
            )
            reasons.append(
                f"the job asks for {amount:g} {name} ({parts}); the cluster has {have:g}"
            )
    return reasons


def total(demands: Sequence[Demand], name: str) -> float:
    """How much of resource `name` all of `demands` ask for together."""
    return sum(d.count * d.resources.get(name, 0.0) for d in demands)


def _largest(nodes: Sequence[Resources], names: Resources) -> dict[str, float]:
    """Per resource the job names, the most any one node offers."""
    return {name: max((node.get(name, 0.0) for node in nodes), default=0.0) for name in names}


def cluster_nodes() -> list[dict[str, float]]:
    """Each alive node's total resources, as Ray reports them."""
    import ray

    return [dict(node["Resources"]) for node in ray.nodes() if node.get("Alive")]


def check_placement(
    cfg: JobConfig,
    *,
    can_grow: bool,
    nodes: Sequence[Resources] | None = None,
    on_event: Callable[[str], None] = print,
) -> None:
    """End the job (`JobEnd`, failed) when its actors cannot be placed and the cluster cannot
    grow; on a cluster that may grow, announce the reasons and go on."""
    reasons = unplaceable(job_demands(cfg), cluster_nodes() if nodes is None else nodes)
    if not reasons:
        return
    if not can_grow:
        raise JobEnd("failed", "cannot place the job's actors: " + "; ".join(reasons))
    on_event(
        "warning: the job's actors do not fit the cluster as it stands, and wait for an "
        "autoscaler to add nodes: " + "; ".join(reasons)
    )


def wait_ready(refs: Mapping[str, Any], timeout_s: float, poll_s: float = 5.0) -> None:
    """Wait for each named actor's readiness call (`refs`: name -> ObjectRef); an actor whose
    start failed raises its error here. Ends the job (`JobEnd`, failed) naming the actors
    not ready within `timeout_s`."""
    import ray

    pending = dict(refs)
    deadline = time.monotonic() + timeout_s
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            raise JobEnd(
                "failed",
                f"actors not ready within store.start_timeout_s ({timeout_s:g} s): "
                f"{', '.join(sorted(pending))} (not placed, or still loading)",
            )
        done, _ = ray.wait(list(pending.values()), num_returns=1, timeout=min(left, poll_s))
        for ref in done:
            ray.get(ref)  # an actor whose __init__ raised: its error, as a crash
        pending = {name: ref for name, ref in pending.items() if ref not in done}
