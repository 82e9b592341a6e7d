"""A simulated job written into a ledger, so a new user can see the reports before any RL.

The simulation drives the real ledger API the way the controller and the workers do:
plan a group, admit, run with turn/tool-call events, score, buffer, train or filter; some
rollouts fail in each named way, one worker dies (its rollouts are reconciled as
`failed_worker_lost` with linked retries), and the job ends with `finish_job`, so `lost`
is 0 at the end.
"""

from __future__ import annotations

import random
import time

from rlsys.ledger.reconcile import finish_job, reconcile_leases
from rlsys.ledger.records import Event, PlannedRollout, Transition
from rlsys.ledger.store import Ledger
from rlsys.types import RolloutState as S

FAILURES = (S.FAILED_SANDBOX, S.FAILED_ENGINE, S.FAILED_TIMEOUT, S.FAILED_REWARD)
FAILURE_REASONS = {
    S.FAILED_SANDBOX: "sandbox exited 137 (memory limit); stderr tail: 'Killed'",
    S.FAILED_ENGINE: "engine replica raised RuntimeError: KV cache exhausted",
    S.FAILED_TIMEOUT: "rollout exceeded its 600 s wall budget",
    S.FAILED_REWARD: "verifier crashed: hidden test runner exited 2",
}


def _one_rollout(
    rng: random.Random, rid: str, job_id: str, owner: str, version: int
) -> tuple[list[Transition], list[Event], float, bool]:
    """Transitions and events of one rollout; returns (transitions, events, reward, done)."""
    turns = max(1, int(rng.lognormvariate(1.2, 0.8)))
    ts = [
        Transition(rid, S.ADMITTED, updates={"owner": owner, "policy_version_first": version}),
        Transition(rid, S.RUNNING),
    ]
    events = [Event(rid, job_id, "admission_wait", data={"wait_ms": rng.randint(0, 40)})]
    tokens = 0
    for turn in range(turns):
        n = rng.randint(20, 400)
        tokens += n
        events.append(Event(rid, job_id, "turn", turn=turn, tokens=n))
        events.append(Event(rid, job_id, "tool_call", turn=turn, data={"tool": "calculator"}))
        if rng.random() < 0.05:
            events.append(
                Event(rid, job_id, "penalty", turn=turn, data={"why": "malformed tool call"})
            )
    # Longer rollouts fail more often, as they do in real agentic RL.
    if rng.random() < 0.02 + 0.01 * turns:
        failure = rng.choice(FAILURES)
        ts.append(
            Transition(
                rid,
                failure,
                reason=FAILURE_REASONS[failure],
                updates={"turns": turns, "completion_tokens": tokens},
            )
        )
        return ts, events, 0.0, False
    reward = float(rng.random() < 0.5)
    ts.append(
        Transition(
            rid,
            S.SCORED,
            updates={
                "turns": turns,
                "completion_tokens": tokens,
                "reward": reward,
                "policy_version_last": version,
            },
        )
    )
    return ts, events, reward, True


def simulate_job(ledger: Ledger, *, groups: int = 32, group_size: int = 8, seed: int = 0) -> str:
    """Write a simulated job into `ledger`; returns its job id."""
    rng = random.Random(seed)
    job_id = ledger.create_job(
        "ledger-demo", {"demo": True, "groups": groups, "group_size": group_size}
    )
    dead_owner = f"worker-{(groups - 1) % 4}"
    for g in range(groups):
        version = g // 4
        planned = [PlannedRollout(f"g{g:04d}", f"task-{g % 7}") for _ in range(group_size)]
        ledger.plan(job_id, planned)
        owner = f"worker-{g % 4}"
        ledger.heartbeat(
            owner, job_id, lease_s=0.05 if owner == dead_owner and g == groups - 1 else 60
        )
        if owner == dead_owner and g == groups - 1:
            # This worker dies mid-rollout: admitted and running, never finished.
            ledger.apply(
                [
                    t
                    for r in planned
                    for t in (
                        Transition(r.id, S.ADMITTED, updates={"owner": owner}),
                        Transition(r.id, S.RUNNING),
                    )
                ]
            )
            continue
        batch_t, batch_e, rewards, finished = [], [], {}, []
        for r in planned:
            ts, es, reward, ok = _one_rollout(rng, r.id, job_id, owner, version)
            batch_t += ts
            batch_e += es
            if ok:
                rewards[r.id] = reward
                finished.append(r.id)
        ledger.apply(batch_t, batch_e)
        zero_var = len(set(rewards.values())) <= 1
        stale = rng.random() < 0.05
        ends = []
        for rid in finished:
            ends.append(Transition(rid, S.BUFFERED))
            if zero_var:
                ends.append(
                    Transition(rid, S.FILTERED_ZERO_VARIANCE, reason="group reward variance 0")
                )
            elif stale:
                ends.append(Transition(rid, S.FILTERED_STALE, reason="staleness 3 > bound 2"))
            else:
                ends.append(Transition(rid, S.TRAINED, updates={"trained_version": version + 1}))
        ledger.apply(ends)
    time.sleep(0.1)  # let the dead worker's lease lapse
    retried = reconcile_leases(ledger, job_id, retry=True, max_attempts=2).retries
    # The retries run on a healthy worker; they are trained or fail like any rollout.
    ledger.heartbeat("worker-0", job_id, lease_s=60)
    for rid in retried.values():
        ts, es, _reward, ok = _one_rollout(rng, rid, job_id, "worker-0", groups // 4)
        if ok:
            ts += [Transition(rid, S.BUFFERED), Transition(rid, S.TRAINED)]
        ledger.apply(ts, es)
    finish_job(ledger, job_id, "completed")
    return job_id
