"""What the serving side looked like at a trainer step: admission queues and prefix-cache hits.

Recorded with each trainer step's metrics (under `serving`), so `rlsys monitor` shows them
next to staleness and drift. Queue depth and running are the admission scheduler's state at
the moment of the step; waits, queue-full refusals and migrations are its counters since
the job started; the prefix-cache hit rate is over every replica's prompt tokens since the
job started (prompt-token weighted). Best effort: a replica that does not answer within
the timeout (dead, or busy loading weights) is left out and counted in `replicas_reporting`.
"""

from __future__ import annotations

import ray
from ray.actor import ActorHandle

from rlsys.control.messages import JsonValue, ReplicaStats


def serving_metrics(
    admission: ActorHandle, replicas: dict[str, ActorHandle], timeout_s: float = 5.0
) -> dict[str, JsonValue]:
    load_ref = admission.load_report.remote()
    refs = [r.stats.remote() for r in replicas.values()]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    prompt = hits = 0
    reporting = 0
    for ref in ready:
        try:
            s: ReplicaStats = ray.get(ref, timeout=0)
        except Exception:  # noqa: BLE001 - a dead replica reports nothing
            continue
        reporting += 1
        prompt += s.prompt_tokens
        hits += s.prefix_cache_hit_tokens
    out: dict[str, JsonValue] = {
        "prefix_cache_hit_rate": hits / prompt if prompt else 0.0,
        "replicas_reporting": reporting,
    }
    try:
        out.update(ray.get(load_ref, timeout=timeout_s))
    except Exception:  # noqa: BLE001 - the step's metrics must not fail on a slow report
        pass
    return out
