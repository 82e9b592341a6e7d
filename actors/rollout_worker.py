"""A rollout worker: runs agent rollouts (scaffold + sandbox) and records them in the ledger.

Invariants:
- the worker owns the rollouts it runs: it sets itself as `owner` when admitting them and
  renews its lease from a heartbeat thread, so if the worker dies, reconciliation ends
  its rollouts as `failed_worker_lost` (nothing is left without a terminal state);
- every turn, tool call, penalty, compaction, admission wait/retry and migration becomes a
  ledger event, written together with the rollout's next transition;
- a failure ends the rollout in its named failed state with the reason (never reward 0);
- a scored trajectory goes to the rollout stream from here, before the ledger records
  `scored`: a `scored` row always has its trajectory in the stream (so a worker's death
  after that cannot lose it), and the driver sees only ids and a few numbers. A worker that
  dies between the two leaves an entry for a rollout reconciled as lost; the trainer's
  inbox discards it;
- a stream that does not answer is retried with bounded backoff for `store.stream_retry_s`
  (publishing is idempotent, so a retry never duplicates): a short outage ends no rollout;
  past the window the rollout ends `failed_stream` (the controller plans a linked retry),
  never `failed_worker_lost`, since no worker died;
- a rollout the job's end (or a stop, or a reconcile) ended before the worker wrote its
  start or its end is reported in that state, not raised: its end is already named, and
  an error there would only outlive the job as noise on the driver's console.
"""

from __future__ import annotations

import pickle
import threading
import time
from functools import partial

import ray
from ray.actor import ActorHandle

from rlsys.actors.handles import ReplicaGenerator, SchedulerProxy
from rlsys.algo.filters import is_penalised
from rlsys.config.job import JobConfig
from rlsys.control.ledger_sink import LedgerEventBuffer
from rlsys.control.ledger_writer import GroupCommitWriter
from rlsys.control.messages import Assignment, RolloutReport
from rlsys.ledger.records import Transition
from rlsys.ledger.store import Ledger
from rlsys.ledger.stream import StreamConnectionError, publish_patiently
from rlsys.rollout.client import AdmittedGenerator
from rlsys.types import RolloutState as S


@ray.remote(max_restarts=0)
class RolloutWorker:
    def __init__(
        self,
        worker_id: str,
        job_id: str,
        ledger_url: str,
        cfg: JobConfig,
        scheduler: ActorHandle,
        replicas: dict[str, ActorHandle],
        stream_url: str,
    ) -> None:
        from rlsys.ledger.stream import open_stream
        from rlsys.rollout.job_sections import scaffold_config
        from rlsys.rollout.tasks.registry import build_task, parse_task_config
        from rlsys.sandboxes.registry import open_sandbox, parse_sandbox_config

        self.worker_id, self.job_id = worker_id, job_id
        self.ledger = Ledger.open(ledger_url, create=False)
        # Concurrent rollouts' writes share transactions (see `ledger_writer`).
        self.writer = GroupCommitWriter(self.ledger)
        self.stream = open_stream(stream_url)
        self.task = build_task(parse_task_config(cfg.rollout.task))
        self.scaffold = scaffold_config(cfg)
        self.open_sandbox = partial(open_sandbox, parse_sandbox_config(cfg.rollout.sandbox))
        self.scheduler = SchedulerProxy(scheduler)
        self.replicas = {rid: ReplicaGenerator(rid, h) for rid, h in replicas.items()}
        self.lease_s = cfg.rollout.lease_s
        self.stream_retry_s = cfg.store.stream_retry_s
        self.ledger.heartbeat(worker_id, job_id, self.lease_s)
        self._stop = threading.Event()
        threading.Thread(target=self._heartbeat, daemon=True).start()

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            try:
                self.ledger.heartbeat(self.worker_id, self.job_id, self.lease_s)
            except Exception:  # a missed beat is retried next period; the lease has slack
                continue

    def ready(self) -> str:
        return self.worker_id

    def run(self, a: Assignment) -> RolloutReport:
        """Run one planned rollout to `scored` (its trajectory published to the stream) or a
        failed state; returns its id, state and reward, never the trajectory."""
        from rlsys.rollout.scaffold import run_rollout

        rid = a.rollout_id
        sink = LedgerEventBuffer(rid, self.job_id)
        admit = [
            Transition(rid, S.ADMITTED, updates={"owner": self.worker_id}),
            Transition(rid, S.RUNNING),
        ]
        ended = self.writer.apply_unless_ended(rid, admit)
        if ended is not None:  # the job ended (or was stopped) before this rollout started
            return RolloutReport(rid, ended, None)
        generator = AdmittedGenerator(self.scheduler, self.replicas, sink.admission)
        started = time.time()
        outcome = run_rollout(
            self.task,
            a.task_index,
            generator,
            config=self.scaffold,
            sink=sink,
            open_sandbox=self.open_sandbox,
            rollout_id=rid,
            group_id=a.group_id,
            session_id=a.session_id,
        )
        traj = outcome.trajectory
        versions = [
            v for s in traj.segments for v, m in zip(s.versions, s.policy_mask, strict=True) if m
        ]
        updates = {
            "turns": traj.num_turns,
            "completion_tokens": traj.num_policy_tokens,
            "prompt_tokens": sum(len(s.token_ids) for s in traj.segments) - traj.num_policy_tokens,
            "policy_version_first": min(versions) if versions else None,
            "policy_version_last": max(versions) if versions else None,
        }
        traj.metadata["wall_s"] = time.time() - started
        entry, retries = None, 0
        if outcome.failure is not None:
            state, reason = S(outcome.failure.state), outcome.failure.reason
        else:
            state, reason = S.SCORED, None
            try:
                entry, retries = publish_patiently(
                    self.stream, rid, pickle.dumps(traj), within_s=self.stream_retry_s
                )
                updates["reward"] = traj.reward
            except StreamConnectionError as err:
                state = S.FAILED_STREAM
                reason = f"the rollout stream stayed unreachable for {self.stream_retry_s:.0f} s: "
                reason += str(err)[:300]
        end = [Transition(rid, state, reason=reason, updates=updates)]
        ended = self.writer.apply_unless_ended(rid, end, sink.drain())
        if ended is not None:  # ended while it ran: its stream entry is discarded unread
            return RolloutReport(rid, ended, entry)
        scored = state is S.SCORED
        return RolloutReport(
            rid,
            state.value,
            entry,
            reward=traj.reward if scored else None,
            penalised=scored and is_penalised(traj.turn_penalties),
            stream_retries=retries,
        )

    def close(self) -> None:
        self._stop.set()
        self.writer.close()
        self.ledger.release(self.worker_id)
        self.ledger.close()
        self.stream.close()
