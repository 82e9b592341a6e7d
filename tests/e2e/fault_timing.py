"""Injecting a fault at the moment it can hurt: while a trainer step is in flight and
rollouts are still being generated and published.

`StepInFlight` watches the job's ledger from a thread: the first time rollouts of the job
are `buffered` (a batch handed to the trainer, which reads their trajectories from the
stream) while others are `admitted`/`running` (workers about to publish), after at least
`min_steps` committed steps, it runs the fault once and records when.
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
        self, ledger_url: str, job_id: str, fault: Callable[[], None], min_steps: int = 1
    ) -> None:
        super().__init__(daemon=True)
        self.ledger_url, self.job_id, self.fault, self.min_steps = (
            ledger_url,
            job_id,
            fault,
            min_steps,
        )
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
                if buffered and generating and steps >= self.min_steps:
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
