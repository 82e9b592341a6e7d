"""Group commit for a rollout worker: its concurrent rollouts' ledger writes in one transaction.

A worker runs many rollouts at once, each writing `admitted`+`running` when it starts and
its end state with its turn events when it finishes. Written one transaction each, they
queue for the connection pool and pay one commit apiece (~25 ms on PostgreSQL on a busy
2-core box: `benchmarks/bench_job_overhead.py`). Here every caller hands its records to
one writer thread, which commits whatever has gathered as one `Ledger.apply`.

Invariants: `apply` returns only after the caller's records are committed (or raises what
the ledger raised for them), so a rollout's write order is what it was; a batch the ledger
refuses (one rollout's transition conflicts, say a stop cancelled it) is re-applied caller
by caller, so one refusal fails only its own caller; `apply_unless_ended` turns the one
refusal that is not an error — the rollout already ended, by a job's end or a reconcile
that raced the worker — into the state it ended in. No Ray: unit-tested.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable
from concurrent.futures import Future

from rlsys.ledger.errors import TransitionConflict
from rlsys.ledger.records import Event, Transition
from rlsys.ledger.store import Ledger
from rlsys.types import is_terminal

_Item = tuple[list[Transition], list[Event], Future[None]]


class GroupCommitWriter:
    def __init__(self, ledger: Ledger, max_batch: int = 512) -> None:
        self.ledger, self.max_batch = ledger, max_batch
        self.batches = 0  # transactions committed (or attempted): for tests and benchmarks
        self._queue: queue.Queue[_Item | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="ledger-writer", daemon=True)
        self._thread.start()

    def apply(self, transitions: Iterable[Transition], events: Iterable[Event] = ()) -> None:
        """Commit these records with whatever else is waiting; blocks until committed."""
        done: Future[None] = Future()
        self._queue.put((list(transitions), list(events), done))
        done.result()

    def apply_unless_ended(
        self, rollout_id: str, transitions: Iterable[Transition], events: Iterable[Event] = ()
    ) -> str | None:
        """`apply` one rollout's records; None once committed. If the ledger refused them
        because the rollout had already ended (the job ended or was stopped and cancelled
        it, a reconcile ended it as lost), returns that terminal state and writes nothing:
        the rollout's end is named already, and the caller must not run or end it again.
        Any other refusal is raised."""
        try:
            self.apply(transitions, events)
        except TransitionConflict:
            state = self.ledger.rollout_state(rollout_id)
            if state is None or not is_terminal(state):
                raise
            return state
        return None

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            batch = [item]
            while len(batch) < self.max_batch:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._commit(batch)
                    return
                batch.append(nxt)
            self._commit(batch)

    def _commit(self, batch: list[_Item]) -> None:
        self.batches += 1
        try:
            self.ledger.apply(
                [t for ts, _, _ in batch for t in ts], [e for _, es, _ in batch for e in es]
            )
        except Exception:  # noqa: BLE001 - isolate the caller the ledger refused
            for ts, es, done in batch:
                try:
                    self.ledger.apply(ts, es)
                except Exception as err:  # noqa: BLE001 - handed to its caller
                    done.set_exception(err)
                else:
                    done.set_result(None)
            return
        for _, _, done in batch:
            done.set_result(None)
