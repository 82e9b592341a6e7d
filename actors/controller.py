"""The driver-side loop of an RL job: plan, dispatch, collect, train, publish weights.

Data flow (DESIGN.md section 3), and the invariants this loop keeps:
- a group's rollouts are written to the ledger as `planned` before any is dispatched;
- at most `rollout.groups_in_flight` groups are open (planned and not yet trained), and
  generation keeps running while the trainer steps (async);
- a step that would push a group still generating past `algo.max_staleness` waits for it
  (a straggler is held for, not thrown away); samples end `filtered_stale` only when the
  bound is broken anyway (ready leftovers after a fault, a resumed job);
- a scored trajectory goes through the rollout stream; the trainer's consumer acknowledges
  its entry only after the optimiser step that consumed it is checkpointed and its
  rollouts are `trained` (or filtered) in the ledger;
- a dead rollout worker's rollouts are reconciled to `failed_worker_lost` (with linked
  retries when configured) and the worker is replaced; a dead engine replica is routed
  around by admission (sessions migrate);
- when the loop ends, for whatever reason, `finish_job` names a state for every rollout
  still live, so `lost` is 0.
"""

from __future__ import annotations

import pickle
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from rlsys.actors.groups import GroupBook
from rlsys.actors.serving_metrics import serving_metrics
from rlsys.actors.weight_publish import make_publisher
from rlsys.config.job import JobConfig
from rlsys.ledger.queries import stats
from rlsys.ledger.reconcile import finish_job, reconcile_leases
from rlsys.ledger.records import Event, PlannedRollout, Transition, new_id
from rlsys.ledger.store import Ledger
from rlsys.ledger.stream import RolloutStream
from rlsys.types import TERMINAL_STATES
from rlsys.types import RolloutState as S

TERMINAL_VALUES = tuple(t.value for t in TERMINAL_STATES)

CONSUMER = "trainer"
MAX_UNSTEPPED_BATCHES = 10


@dataclass
class JobHandles:
    admission: Any
    replicas: dict[str, Any]
    workers: dict[str, Any]
    trainer: Any


@dataclass
class RunStats:
    steps: list[dict[str, Any]] = field(default_factory=list)
    worker_deaths: int = 0
    stale_filtered: int = 0
    staleness_holds: int = 0  # times a ready step started waiting for a straggler
    replicas_dropped: list[str] = field(default_factory=list)  # died, found by a publication
    started: float = field(default_factory=time.time)


class Controller:
    """Runs one job to completion (or to a stop request) against live actors."""

    def __init__(
        self,
        cfg: JobConfig,
        job_id: str,
        ledger: Ledger,
        stream: RolloutStream,
        handles: JobHandles,
        make_worker: Callable[[str], Any],
        *,
        run_dir: Path,
        start_step: int = 0,
        start_version: int = 0,
        on_step: Callable[[dict[str, Any]], None] | None = None,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> None:
        self.cfg, self.job_id, self.ledger, self.stream = cfg, job_id, ledger, stream
        self.h, self.make_worker, self.run_dir = handles, make_worker, run_dir
        self.step, self.version = start_step, start_version
        self.on_step, self.should_stop = on_step or (lambda m: None), should_stop
        self.book = GroupBook()
        self.publisher = make_publisher(cfg.engine)
        self.rng = random.Random(cfg.seed * 1_000_003 + start_step)
        self.pending: list[dict[str, Any]] = []  # assignments not yet dispatched
        self.running: dict[Any, tuple[str, dict[str, Any]]] = {}  # ref -> (worker, assignment)
        self.slots: dict[str, int] = {w: 0 for w in handles.workers}
        self.train_ref: Any = None
        self.train_batch: list[Any] = []
        self.stats = RunStats()
        self.samples = 0
        self.consecutive_failures = 0
        self.unstepped = 0
        self._holding = False
        self._stop_checked = 0.0

    # -- planning and dispatch -----------------------------------------------------------
    def _plan_groups(self) -> None:
        # Plan only what the remaining steps can consume, so a finished job leaves (almost)
        # nothing in flight to cancel: cancelled rollouts count as dropped.
        # The window counts the groups being trained too: with it at most
        # groups_per_step * (max_staleness + 1) (validated), the oldest open group is always
        # trainable before it goes stale, so the staleness gate below never deadlocks.
        per_step = self.cfg.trainer.groups_per_step
        in_step = per_step if self.train_batch else 0
        needed = (self.cfg.trainer.steps - self.step) * per_step
        limit = self.cfg.rollout.groups_in_flight
        if self.cfg.rollout.pipeline == "sync":
            # The baseline: nothing is generated while the trainer steps, and one step's
            # groups at a time, so every sample is generated by the newest weights.
            if self.train_ref is not None:
                return
            limit = per_step
        while self.book.open_groups + in_step < min(limit, needed):
            gid, index = new_id("g"), self.rng.randrange(1 << 30)
            task_id = f"{self.cfg.rollout.task.get('type', 'task')}/{index}"
            planned = [PlannedRollout(gid, task_id) for _ in range(self.cfg.rollout.group_size)]
            self.ledger.plan(self.job_id, planned)  # "expected" before anything is dispatched
            self.book.add(gid, index, [p.id for p in planned], self.version)
            self.pending += [self._assignment(p, index) for p in planned]

    @staticmethod
    def _assignment(p: PlannedRollout, index: int) -> dict[str, Any]:
        return {
            "rollout_id": p.id,
            "group_id": p.group_id,
            "task_index": index,
            "session_id": p.session_id,
        }

    def _dispatch(self) -> None:
        per_worker = self.cfg.rollout.concurrency_per_worker
        while self.pending:
            free = [w for w, n in self.slots.items() if n < per_worker]
            if not free:
                return
            worker = min(free, key=lambda w: self.slots[w])
            a = self.pending.pop(0)
            ref = self.h.workers[worker].run.remote(a)
            self.running[ref] = (worker, a)
            self.slots[worker] += 1

    # -- results ---------------------------------------------------------------------------
    def _on_rollout_done(self, ref: Any) -> None:
        worker, a = self.running.pop(ref)
        self.slots[worker] = max(0, self.slots.get(worker, 0) - 1)
        try:
            result = ray.get(ref)
        except (RayActorError, RayTaskError) as err:
            self._on_worker_failure(worker, err, a)
            return
        rid = result["rollout_id"]
        if result["state"] == S.SCORED.value:
            self.consecutive_failures = 0
            entry = self.stream.publish(rid, pickle.dumps(result["trajectory"]))
            self.book.scored(rid, entry, result["trajectory"])
            return
        self.book.failed(rid)
        self.consecutive_failures += 1
        limit = max(32, 4 * self.cfg.rollout.group_size * self.cfg.rollout.groups_in_flight)
        if self.consecutive_failures >= limit:
            # A systematic failure (broken sandbox, engine, task) must end the job loudly,
            # not spin forever planning rollouts that all fail.
            reason = self.ledger.rollout_reason(rid) or result["state"]
            raise RuntimeError(
                f"the last {limit} rollouts all failed; the most recent ended "
                f"{result['state']}: {reason}"
            )

    def _on_worker_failure(self, worker: str, err: BaseException, first: dict[str, Any]) -> None:
        """A worker died: end its rollouts as lost (with linked retries) and replace it."""
        if worker not in self.h.workers:
            return  # already handled for another of its in-flight rollouts
        self.stats.worker_deaths += 1
        del self.h.workers[worker]
        self.slots.pop(worker, None)
        self.ledger.release(worker)
        result = reconcile_leases(
            self.ledger,
            self.job_id,
            retry=self.cfg.rollout.retry_lost,
            max_attempts=self.cfg.rollout.max_attempts,
        )
        for lost in result.lost:
            retry = result.retries.get(lost)
            if lost in self.book.group_of:
                self.book.failed(lost, retry)
                if retry:
                    g = self.book.groups[self.book.group_of[retry]]
                    self.pending.append(
                        {
                            "rollout_id": retry,
                            "group_id": g.group_id,
                            "task_index": g.task_index,
                            "session_id": new_id("s"),
                        }
                    )
        # Every other rollout dispatched to this worker fails its ref too. Those it had started
        # were ended by the reconciliation above; one it never started is still `planned` and
        # goes back to the queue; one it scored but never handed over lost its trajectory
        # with the worker, so it ends as lost and is retried like the others.
        handled = set(result.lost)
        dropped = [first]
        for ref, (w, a) in list(self.running.items()):
            if w == worker:
                del self.running[ref]
                dropped.append(a)
        # Slots its requests held on the replicas would otherwise never be released.
        ray.get(self.h.admission.cancel_sessions.remote([a["session_id"] for a in dropped]))
        for a in dropped:
            rid = a["rollout_id"]
            if rid in handled:
                continue
            state = self.ledger.rollout_state(rid)
            if state == S.PLANNED.value:
                self.pending.append(a)
            elif state not in (None, *TERMINAL_VALUES):
                self._end_lost_and_retry(rid, a, f"worker {worker} died before handing it over")
        replacement = f"worker-{new_id('w')[2:10]}"
        self.h.workers[replacement] = self.make_worker(replacement)
        self.slots[replacement] = 0

    def _end_lost_and_retry(self, rid: str, a: dict[str, Any], reason: str) -> None:
        self.ledger.apply([Transition(rid, S.FAILED_WORKER_LOST, reason=reason)])
        retry = None
        if self.cfg.rollout.retry_lost and self.cfg.rollout.max_attempts > 1:
            planned = PlannedRollout(
                a["group_id"],
                f"{self.cfg.rollout.task.get('type', 'task')}/{a['task_index']}",
                attempt=1,
                retry_of=rid,
            )
            self.ledger.plan(self.job_id, [planned])
            self.ledger.record_events(
                [
                    Event(rid, self.job_id, "retried_as", data={"rollout_id": planned.id}),
                    Event(planned.id, self.job_id, "retry_of", data={"rollout_id": rid}),
                ]
            )
            retry = planned.id
            self.pending.append(self._assignment(planned, a["task_index"]))
        if rid in self.book.group_of:
            self.book.failed(rid, retry)

    # -- training --------------------------------------------------------------------------
    def _maybe_start_step(self) -> None:
        if self.train_ref is not None:
            return
        self.book.drop_dead()
        groups = self.book.take_ready(self.cfg.trainer.groups_per_step)
        if len(groups) < self.cfg.trainer.groups_per_step or self._would_strand_a_straggler():
            for g in groups:  # not yet: put them back (take_ready keeps planning order)
                self.book.groups[g.group_id] = g
            self.book.groups = dict(
                sorted(self.book.groups.items(), key=lambda kv: kv[1].planned_version)
            )
            return
        batch = [(rid, entry, traj) for g in groups for rid, (entry, traj) in g.scored.items()]
        self.ledger.apply([Transition(rid, S.BUFFERED) for rid, _, _ in batch])
        self.train_batch = batch
        self.train_ref = self.h.trainer.step.remote([t for _, _, t in batch], self.version)

    def _would_strand_a_straggler(self) -> bool:
        """After this step the version is v+1; a group still generating, planned at version
        u, is then trained at v+1 or later, which must stay within the staleness bound.

        Only a group still generating is waited for: a ready group left over cannot get
        any fresher by waiting (with the validated window that happens only after faults,
        e.g. retries of a dead worker's rollouts), so the step goes ahead and it is
        filtered stale rather than the job stalling."""
        oldest = self.book.oldest_unready_version()
        if oldest is None or self.version + 1 - oldest <= self.cfg.algo.max_staleness:
            self._holding = False
            return False
        self.stats.staleness_holds += 0 if self._holding else 1
        self._holding = True
        return True

    def _on_step_done(self) -> None:
        out = ray.get(self.train_ref)
        self.train_ref = None
        batch, self.train_batch = self.train_batch, []
        if out["stepped"]:
            self.step += 1
        self.version = out["version"]
        consumed = [rid for rid, _, _ in batch]
        ray.get(
            self.h.trainer.checkpoint.remote(
                str(self.run_dir / "checkpoint"),
                {
                    "step": self.step,
                    "version": self.version,
                    "job_id": self.job_id,
                    "consumed_rollouts": consumed,
                    "consumed_entries": [e for _, e, _ in batch],
                },
            )
        )
        filtered = {f["rollout_id"]: f for f in out["filtered"]}
        self.stats.stale_filtered += sum(
            f["state"] == S.FILTERED_STALE.value for f in filtered.values()
        )
        ends = [
            Transition(rid, S(filtered[rid]["state"]), reason=filtered[rid]["reason"])
            if rid in filtered
            else Transition(rid, S.TRAINED, updates={"trained_version": self.version})
            for rid in consumed
        ]
        self.ledger.apply(ends)
        self.stream.ack([e for _, e, _ in batch])  # only now: the step is committed
        if not out["stepped"]:
            # Everything was filtered: no new version, nothing to publish. A run of such
            # batches means no learning signal at all; end loudly instead of spinning.
            self.unstepped += 1
            if self.unstepped >= MAX_UNSTEPPED_BATCHES:
                raise RuntimeError(
                    f"no learning signal: {self.unstepped} batches in a row were entirely filtered "
                    "(zero reward variance or stale); the task is too hard or too easy for this policy"
                )
            return
        self.unstepped = 0
        elapsed = time.time() - self.stats.started
        self.samples += len(consumed)
        metrics = {
            **out["metrics"],
            "step": self.step,
            "policy_version": self.version,
            "drop_rate": stats(self.ledger, self.job_id)["drop_rate"],
            "samples_per_s": self.samples / elapsed if elapsed > 0 else 0.0,
            "serving": serving_metrics(self.h.admission, self.h.replicas),
        }
        self.ledger.record_trainer_step(self.job_id, self.step, self.version, metrics)
        self.broadcast_weights()
        self.stats.steps.append(metrics)
        self.on_step({**metrics, "job_id": self.job_id})

    def broadcast_weights(self) -> None:
        """Publish the trainer's weights as `self.version` to every live replica.

        A replica that died is dropped here and marked dead in admission (its sessions
        migrate); the job goes on while at least one replica lives.
        """
        for rid in self.publisher.publish(self.h.trainer, self.h.replicas, self.version):
            del self.h.replicas[rid]
            ray.get(self.h.admission.mark_dead.remote(rid))
            self.stats.replicas_dropped.append(rid)
        if not self.h.replicas:
            raise RuntimeError("every engine replica has died")

    # -- the loop ----------------------------------------------------------------------------
    def run(self) -> str:
        """Run until `trainer.steps` optimiser steps are taken; returns the job end status."""
        status = "completed"
        try:
            while self.step < self.cfg.trainer.steps:
                if time.time() - self._stop_checked > 1.0:
                    self._stop_checked = time.time()
                    if self.should_stop():
                        status = "stopped"
                        break
                self._plan_groups()
                self._dispatch()
                self._maybe_start_step()
                refs = list(self.running) + ([self.train_ref] if self.train_ref is not None else [])
                if not refs:
                    raise RuntimeError(
                        "nothing in flight and no step possible: the job cannot progress"
                    )
                done, _ = ray.wait(refs, num_returns=1, timeout=1.0)
                for ref in done:
                    if ref is self.train_ref or ref == self.train_ref:
                        self._on_step_done()
                    elif ref in self.running:
                        self._on_rollout_done(ref)
        except KeyboardInterrupt:
            status = "stopped"
        except BaseException:
            status = "failed"
            raise
        finally:
            self._shutdown_inflight()
            finish_job(self.ledger, self.job_id, status)
        return status

    def _shutdown_inflight(self) -> None:
        for ref in list(self.running):
            ray.cancel(ref, force=False)
        if self.train_ref is not None:
            ray.cancel(self.train_ref, force=False)
