"""Injecting a fault at the moment it can hurt: while a trainer step is in flight and
rollouts are still being generated and published.

`StepInFlight` watches the job's ledger from a thread: the first time rollouts of the job
are `buffered` (a batch handed to the trainer, which reads their trajectories from the
stream) while others are `admitted`/`running` (workers about to publish), after at least
`min_steps` committed steps (and, with `max_steps`, at most that many), it runs the fault
once and records when.

`max_steps` is for a fault the job can only notice when it next uses what was hit: a
trainer killed as the job's last step finishes may die after the driver's last call to
it, unseen. Firing while the step in flight is not the last leaves a step to meet it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import sqlalchemy as sa

IN_FLIGHT_SQL = """
SELECT
  (SELECT count(*) FROM rollouts WHERE job_id = :j AND state = 'buffered'),
  (SELECT count(*) FROM rollouts WHERE job_id = :j AND state IN ('admitted', 'running')),
  (SELECT count(*) FROM trainer_steps WHERE job_id = :j)
"""


class StepInFlight(threading.Thread):
    def __init__(
        self,
        ledger_url: str,
        job_id: str,
        fault: Callable[[], None],
        min_steps: int = 1,
        max_steps: int | None = None,
    ) -> None:
        super().__init__(daemon=True)
        self.ledger_url, self.job_id, self.fault = ledger_url, job_id, fault
        self.min_steps, self.max_steps = min_steps, max_steps
        self.fired: dict[str, int] | None = None  # what the ledger showed when it fired
        self.error: BaseException | None = None
        self._done = threading.Event()

    def run(self) -> None:
        engine = sa.create_engine(self.ledger_url.replace("postgresql://", "postgresql+psycopg://"))
        try:
            while not self._done.is_set():
                try:
                    with engine.connect() as conn:
                        row = conn.execute(sa.text(IN_FLIGHT_SQL), {"j": self.job_id}).one()
                except sa.exc.DBAPIError:
                    row = (0, 0, 0)  # the schema not there yet
                buffered, generating, steps = row
                in_window = steps >= self.min_steps and (
                    self.max_steps is None or steps <= self.max_steps
                )
                if buffered and generating and in_window:
                    engine.dispose()  # hold no connection across the fault
                    self.fired = {"buffered": buffered, "generating": generating, "steps": steps}
                    self.fault()
                    return
                time.sleep(0.05)
        except BaseException as err:  # noqa: BLE001 - reported to the test
            self.error = err
        finally:
            engine.dispose()

    def stop(self) -> None:
        self._done.set()
        self.join(timeout=300)
        if self.error is not None:
            raise self.error
