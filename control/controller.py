"""The driver-side loop of an RL job, with its actors behind an injected edge.

The decisions live in small units, unit-tested in tests/control: `Planner` (planning, the
window, the staleness gate), `FailureHandler` (failed rollouts, task errors, dead workers,
retries through the ledger's reconcile) and `StepCommitter` (the step's ledger commit, and
agreeing with a restored checkpoint). This loop moves typed messages
(`rlsys.control.messages`) between them and the actors, and waits. The actors are reached
only through a `JobCluster` (`rlsys.control.cluster`): Ray's is
`rlsys.actors.ray_cluster.RayCluster`; tests/control/test_controller.py drives the loop
through a fake one, with a real ledger. No Ray here.

Data flow: workers publish scored trajectories to the rollout stream
themselves and answer the controller with ids and states; the controller names a step's
rollout ids to the trainer, which reads them from the stream and acknowledges their entries
only after `StepCommitter.commit` has ended them `trained` (or filtered) in the ledger.
No token array crosses the driver (docs/ARCHITECTURE.md, "One step of data flow").

Invariants kept here:
- a dead worker (its actor died) is told apart from a task error inside a live one; the
  dead one is killed for good (`no_restart`) and replaced;
- a dead trainer is killed and replaced from its checkpoint: the stream gives the new one
  every entry the old one read and did not acknowledge, the checkpoint's consumed rollouts
  are ended in the ledger if the crash came before that, and an unfinished step is redone;
  the ledger's step numbering goes on (`_agree_on_step`); checkpoints are written every
  `trainer.checkpoint_every` steps, at the last step, and at a stop;
- every finished group is sifted (`Planner.sift`): one without a learning signal is ended
  `filtered_zero_variance` here and replaced by a new group, so the trainer gets
  `trainer.groups_per_step` informative groups per step, within the generation bound;
- the loop ends with a named end, never a bare crash for a known cause (`JobEnd`): the
  steps done, the task solved, no learning signal, every replica dead, a systematic
  failure; `run` returns the status and reason and the driver ends the job in the ledger
  with them (`rlsys.control.job_lifetime`), naming a state for every live rollout.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlsys.config.job import JobConfig
from rlsys.control.cluster import ActorDied, JobCluster, Pending, TaskFailed
from rlsys.control.failures import FailureHandler, Recovery, SystematicFailure
from rlsys.control.groups import Group
from rlsys.control.job_end import JobEnd, describe_crash
from rlsys.control.messages import Assignment, StepReport, TrainerPosition
from rlsys.control.planner import Planner, task_index_of
from rlsys.control.step_commit import StepCommitter
from rlsys.ledger.queries import last_trainer_step, parked_rollouts, stats, task_rewards
from rlsys.ledger.reconcile import retry_ended
from rlsys.ledger.records import Transition, new_id
from rlsys.ledger.store import Ledger
from rlsys.types import RolloutState as S

MAX_UNSTEPPED_BATCHES = 10
MAX_STEP_ERRORS = 8
# A step's trajectories are in the stream before their workers report them scored, so the
# trainer finds them at once; the bound only turns a lost entry into an error, not a hang.
STREAM_WAIT_S = 300.0


@dataclass
class RunStats:
    steps: list[dict[str, Any]] = field(default_factory=list)
    worker_deaths: int = 0
    task_errors: int = 0
    trainer_restarts: int = 0
    stale_filtered: int = 0
    redelivered: int = 0  # stream entries handed again to a (re)started trainer
    replicas_dropped: list[str] = field(default_factory=list)  # died, found by a publication
    stream_retries: int = 0  # publishes workers retried while the stream was unreachable
    stream_failed: int = 0  # rollouts ended failed_stream (the stream down past the window)
    step_retries: int = 0  # trainer steps asked again after an error (the stream unreachable)
    ack_retries: int = 0  # acknowledgements deferred to the next step (the stream unreachable)
    started: float = field(default_factory=time.time)


class Controller:
    """Runs one job to completion (or to a stop request) against the actors of `cluster`."""

    def __init__(
        self,
        cfg: JobConfig,
        job_id: str,
        ledger: Ledger,
        cluster: JobCluster,
        *,
        run_dir: Path,
        start: TrainerPosition,
        on_step: Callable[[dict[str, Any]], None] | None = None,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> None:
        self.cfg, self.job_id, self.ledger = cfg, job_id, ledger
        self.cluster = cluster
        self.run_dir = run_dir
        self.step, self.version = start.step, start.version
        self.on_step, self.should_stop = on_step or (lambda m: None), should_stop
        history = [
            (index, reward)
            for task, reward in task_rewards(ledger, job_id)
            if (index := task_index_of(task)) is not None
        ]
        self.planner = Planner(cfg, job_id, ledger, seed_step=start.step, history=history)
        self.planner.version = start.version
        self.failures = FailureHandler(cfg, job_id, ledger, self.planner.book)
        self.committer = StepCommitter(ledger, job_id)
        self.pending: list[Assignment] = []  # not yet dispatched
        self.running: dict[Pending, tuple[str, Assignment]] = {}  # -> (worker, assignment)
        self.slots: dict[str, int] = {w: 0 for w in cluster.workers}
        self.train_ref: Pending | None = None
        self.train_batch: list[str] = []
        self.discard: list[str] = []  # ended untrained: the trainer acks any entry they left
        self.stats = RunStats(redelivered=start.redelivered)
        self.samples = 0
        self.unstepped = 0
        self.step_errors = 0
        self.unacked: list[str] = []  # committed in the ledger, ack not yet confirmed
        self._stop_checked = 0.0
        self._adopt(start)

    def _adopt(self, start: TrainerPosition) -> None:
        """Agree with the trainer's checkpoint, then take back what a stopped run parked."""
        self.committer.recover(start)
        self._agree_on_step(start)
        parked = parked_rollouts(self.ledger, self.job_id)
        self.planner.adopt_parked(parked)
        self.committer.buffered.update(r for r, _, state, _ in parked if state == S.BUFFERED)
        self._ack_orphans()

    def _ack_orphans(self) -> None:
        """Entries a (re)started trainer holds for rollouts that are no longer live (ended
        while the last trainer or run stopped, filtered here, cancelled mid-publish) are
        acknowledged: nothing is trained twice, and the stream is trimmed."""
        live = {r for r, *_ in parked_rollouts(self.ledger, self.job_id)}
        orphans = [r for r in self.cluster.trainer_held() if r not in live]
        if orphans:
            self.cluster.trainer_commit([], orphans)

    # -- rollouts ----------------------------------------------------------------------------
    def _dispatch(self) -> None:
        per_worker = self.cfg.rollout.concurrency_per_worker
        while self.pending:
            free = [w for w, n in self.slots.items() if n < per_worker]
            if not free:
                return
            worker = min(free, key=lambda w: self.slots[w])
            a = self.pending.pop(0)
            self.running[self.cluster.run_rollout(worker, a)] = (worker, a)
            self.slots[worker] += 1

    def _on_rollout_done(self, ref: Pending) -> None:
        worker, a = self.running.pop(ref)
        self.slots[worker] = max(0, self.slots.get(worker, 0) - 1)
        try:
            report = self.cluster.rollout_result(ref)
        except ActorDied:
            self._on_worker_death(worker, a)
            return
        except TaskFailed as err:  # an exception inside a live worker's `run`
            self.stats.task_errors += 1
            self._recover(self.failures.task_error(worker, a, err.cause))
            return
        self.stats.stream_retries += report.stream_retries
        if report.state == S.SCORED.value:
            self.failures.succeeded()
            self.planner.scored(report)
        else:
            self.planner.failed()
            try:
                self.failures.rollout_failed(report)
            except SystematicFailure as err:
                raise JobEnd("failed", str(err)) from err
            if report.state == S.FAILED_STREAM.value:
                self._retry_stream_failure(a)
        self._sift()

    def _retry_stream_failure(self, a: Assignment) -> None:
        """The stream stayed unreachable past the worker's retry window: the rollout ended
        `failed_stream`; a linked retry takes its place in the group."""
        self.stats.stream_failed += 1
        retries = retry_ended(
            self.ledger, self.job_id, [a.rollout_id], max_attempts=self.cfg.rollout.max_attempts
        )
        retry = retries.get(a.rollout_id)
        if retry is None or a.rollout_id not in self.planner.book.group_of:
            return
        self.planner.book.failed(a.rollout_id, retry)
        if self.planner.book.group_of.get(retry) in self.planner.book.groups:
            self.pending.append(Assignment(retry, a.group_id, a.task_index, new_id("s")))

    def _sift(self) -> None:
        """End the finished groups that carry no learning signal; planning replaces them."""
        dropped: list[tuple[Group, str]] = self.planner.sift()
        ends = [
            Transition(rid, S.FILTERED_ZERO_VARIANCE, reason=reason)
            for group, reason in dropped
            for rid in sorted(group.members)
        ]
        if ends:
            self.ledger.apply(ends)
            self.discard += [t.rollout_id for t in ends]  # the trainer acks their entries

    def _on_worker_death(self, worker: str, first: Assignment) -> None:
        if worker not in self.slots:
            return  # already handled for another of its in-flight rollouts
        self.stats.worker_deaths += 1
        self.slots.pop(worker)
        self.cluster.kill_worker(worker)  # before its rollouts are reconciled
        dropped = [first]
        for ref, (w, a) in list(self.running.items()):
            if w == worker:
                del self.running[ref]
                dropped.append(a)
        # Slots its requests held on the replicas would otherwise never be released.
        self.cluster.cancel_sessions([a.session_id for a in dropped])
        self._recover(self.failures.worker_died(worker, dropped))
        replacement = f"worker-{new_id('w')[2:10]}"
        self.cluster.start_worker(replacement)
        self.slots[replacement] = 0

    def _recover(self, recovery: Recovery) -> None:
        self.pending = recovery.dispatch + self.pending
        self.discard += recovery.ended
        self._sift()  # a failure can complete a group

    # -- training ----------------------------------------------------------------------------
    def _maybe_start_step(self) -> None:
        if self.train_ref is not None:
            return
        groups = self.planner.next_batch()
        if groups is None:
            return
        self.train_batch = [r for g in groups for r in sorted(g.scored & g.members)]
        self.committer.buffer(self.train_batch)
        self.train_ref = self.cluster.train_step(self.train_batch, STREAM_WAIT_S)

    def _on_step_done(self, ref: Pending) -> None:
        batch = self.train_batch
        try:
            report = self.cluster.step_result(ref)
            next_step = self.step + (1 if report.stepped else 0)
            if report.stepped and self._checkpoint_due(next_step):
                position = self.committer.checkpoint_position(
                    next_step, report.version, batch, report
                )
                self.cluster.checkpoint(str(self._checkpoint), position)
        except ActorDied:
            self._on_trainer_death()
            return
        except TaskFailed as err:
            self._retry_step(err)
            return
        self.step_errors = 0
        self.train_ref, self.train_batch = None, []
        self.step, self.version = next_step, report.version
        self.planner.version = self.version
        metrics = self._step_metrics(report, len(batch)) if report.stepped else None
        if metrics is not None:
            self.ledger.record_trainer_step(self.job_id, self.step, self.version, metrics)
        self.stats.stale_filtered += self.committer.commit(batch, report.filtered, self.version)
        self._ack(batch)
        if metrics is None:
            # Everything was filtered (stale, or by the trainer's own filter): no new
            # version, nothing to publish. A run of such batches ends the job, named.
            self.unstepped += 1
            if self.unstepped >= MAX_UNSTEPPED_BATCHES:
                raise JobEnd(
                    "failed",
                    f"no learning signal: the trainer filtered all of {self.unstepped} batches "
                    "in a row (stale or equal rewards)",
                )
            return
        self.unstepped = 0
        self.broadcast_weights()
        self.stats.steps.append(metrics)
        self.on_step({**metrics, "job_id": self.job_id})

    def _end_if_solved(self) -> None:
        """End the job `completed` (solved) once the task's pass rate reaches its goal, with
        the solved policy checkpointed whatever `checkpoint_every` is. Called with no step in
        flight: the weights are then exactly the committed steps'."""
        try:
            self.planner.raise_if_solved()
        except JobEnd:
            self._checkpoint_now()
            raise

    def _retry_step(self, err: TaskFailed) -> None:
        """The step raised inside a live trainer (e.g. the stream unreachable for a while):
        the trainer still holds what it read, so the same step is asked again, after a
        backoff; a persistent error ends the job."""
        self.step_errors += 1
        self.stats.step_retries += 1
        if self.step_errors > MAX_STEP_ERRORS:
            raise JobEnd(
                "failed",
                f"the trainer's step failed {MAX_STEP_ERRORS} times in a row; last: "
                + describe_crash(err.cause),
            ) from err
        time.sleep(min(10.0, 0.5 * 2 ** (self.step_errors - 1)))
        self.train_ref = self.cluster.train_step(self.train_batch, STREAM_WAIT_S)

    def _ack(self, batch: list[str]) -> None:
        """The ledger holds the step: the trainer may now acknowledge its entries. An ack
        that fails (the stream unreachable) is retried with the next one: until then the
        entries stay pending, which delays trimming but loses nothing."""
        unacked, self.unacked = self.unacked + batch, []
        discard, self.discard = self.discard, []
        try:
            self.cluster.trainer_commit(unacked, discard)
        except ActorDied:
            # The checkpoint records the step's entries: the next trainer acks them; older
            # unacked ones are redelivered to it and acked at its first commit.
            self.unacked = [r for r in unacked if r not in batch]
            self._on_trainer_death()
        except TaskFailed:
            self.stats.ack_retries += 1
            self.unacked, self.discard = unacked, discard + self.discard

    def _step_metrics(self, report: StepReport, samples: int) -> dict[str, Any]:
        elapsed = time.time() - self.stats.started
        self.samples += samples
        profiles = self.planner.profiles
        return {
            **report.metrics,
            **self.planner.closed.as_metrics(),
            "filtered_stale": sum(f.state == S.FILTERED_STALE.value for f in report.filtered),
            "task_pass_rate": profiles.pass_rate(),
            "fresh_pass_rate": profiles.fresh_pass_rate(),
            "prompt_mix": profiles.mix(),
            "step": self.step,
            "policy_version": self.version,
            "drop_rate": stats(self.ledger, self.job_id)["drop_rate"],
            "samples_per_s": self.samples / elapsed if elapsed > 0 else 0.0,
            "serving": self.cluster.serving_metrics(),
        }

    @property
    def _checkpoint(self) -> Path:
        return self.run_dir / "checkpoint"

    def _checkpoint_due(self, step: int) -> bool:
        return step % self.cfg.trainer.checkpoint_every == 0 or step >= self.cfg.trainer.steps

    def _checkpoint_now(self) -> None:
        """At a stop with no step in flight, the weights are exactly the committed steps':
        a checkpoint makes the resume exact whatever `checkpoint_every` is."""
        empty = StepReport(False, self.version, {})
        position = self.committer.checkpoint_position(self.step, self.version, [], empty)
        try:
            self.cluster.checkpoint(str(self._checkpoint), position)
        except ActorDied:
            return  # the resume starts from the last checkpoint and the ledger's step

    def _agree_on_step(self, start: TrainerPosition) -> None:
        """The ledger's newest committed step wins over an older checkpoint.

        With `trainer.checkpoint_every` N > 1 a replaced (or resumed) trainer may come back
        up to N - 1 steps behind: the updates of those steps are lost with the old trainer,
        but their samples did reach an optimiser step (they stay `trained`, and their stream
        entries were acknowledged), so the job carries on from the ledger's step rather than
        train other samples under the same step numbers."""
        self.step, self.version = start.step, start.version
        committed = last_trainer_step(self.ledger, self.job_id)
        if committed is not None and committed[0] > self.step:
            self.step, self.version = committed
            self.cluster.set_trainer_position(self.step, self.version)
        self.planner.version = self.version

    def _on_trainer_death(self) -> None:
        """Kill the old trainer, start one from the checkpoint, redo what was not committed."""
        self.stats.trainer_restarts += 1
        start = self.cluster.replace_trainer()
        self.stats.redelivered += start.redelivered
        recovered = set(self.committer.recover(start))
        self._agree_on_step(start)
        self.train_ref = None
        batch = [r for r in self.train_batch if r not in recovered]
        self.train_batch = []
        self._ack_orphans()
        if batch:  # the unfinished step, redone on the same rollouts (still `buffered`)
            self.train_batch = batch
            self.train_ref = self.cluster.train_step(batch, STREAM_WAIT_S)
        self.broadcast_weights()

    def broadcast_weights(self) -> None:
        """Publish the trainer's weights as `self.version` to every live replica.

        A replica that died is dropped here and marked dead in admission (its sessions
        migrate); the job goes on while at least one replica lives. A trainer that died
        is replaced first.
        """
        try:
            dropped = self.cluster.publish_weights(self.version)
        except ActorDied:
            self._on_trainer_death()
            return
        for rid in dropped:
            self.cluster.drop_replica(rid)
            self.stats.replicas_dropped.append(rid)
        if not self.cluster.replicas:
            raise JobEnd("failed", "every engine replica has died")

    # -- the loop ----------------------------------------------------------------------------
    def run(self) -> tuple[str, str | None]:
        """Run until `trainer.steps` optimiser steps are taken, the task is solved, a stop is
        asked or a named end comes; returns the end's status and reason. A crash (any
        other exception) is raised after the in-flight work is cancelled."""
        try:
            return self._loop()
        except JobEnd as end:
            if end.status == "stopped" and self.train_ref is None:
                self._checkpoint_now()
            return end.status, end.reason
        except KeyboardInterrupt:
            return "stopped", "interrupted (SIGINT or SIGTERM)"
        finally:
            self._shutdown_inflight()

    def _loop(self) -> tuple[str, str | None]:
        while self.step < self.cfg.trainer.steps:
            if self._stop_requested():
                raise JobEnd("stopped", "stop requested (rlsys jobs stop)")
            if self.train_ref is None:
                # Checked as each rollout is scored, not only after a step: once the evidence
                # is in, more groups of solved prompts would only be filtered as zero-variance.
                self._end_if_solved()
            self.pending += self.planner.plan(step=self.step, training=self.train_ref is not None)
            self._dispatch()
            self._maybe_start_step()
            refs = list(self.running) + ([self.train_ref] if self.train_ref is not None else [])
            if not refs:
                raise JobEnd("failed", "nothing in flight and no step possible")
            for ref in self.cluster.wait(refs, timeout_s=1.0):
                if self.train_ref is not None and ref == self.train_ref:
                    self._on_step_done(ref)
                elif ref in self.running:
                    self._on_rollout_done(ref)
        return "completed", f"{self.step} steps"

    def _stop_requested(self) -> bool:
        if time.time() - self._stop_checked <= 1.0:
            return False
        self._stop_checked = time.time()
        return self.should_stop()

    def _shutdown_inflight(self) -> None:
        for ref in list(self.running):
            self.cluster.cancel(ref)
        if self.train_ref is not None:
            self.cluster.cancel(self.train_ref)
