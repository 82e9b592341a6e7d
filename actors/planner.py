"""Planning and the staleness gate: which groups exist, and when a step may start.

Invariants:
- a group's rollouts are written to the ledger as `planned` before any is handed out;
- at most `rollout.groups_in_flight` groups are open (planned and not yet trained), the
  groups being trained included; only what the remaining steps can consume is planned;
- in `sync` mode nothing is planned while the trainer steps, and one step's groups at a
  time, so every sample comes from the newest weights;
- a step that would push a group still generating past `algo.max_staleness` waits for
  it (a straggler is held for, not thrown away); a ready group left over is never waited
  for (it cannot get fresher), so the job cannot stall on the gate.
With the validated window (groups_in_flight <= groups_per_step * (max_staleness + 1)) the
oldest open group is always trainable before it goes stale. No Ray: unit-tested.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from rlsys.actors.groups import Group, GroupBook
from rlsys.actors.messages import Assignment
from rlsys.config.job import JobConfig
from rlsys.ledger.records import PlannedRollout, new_id
from rlsys.ledger.store import Ledger


def task_id(cfg: JobConfig, task_index: int) -> str:
    return f"{cfg.rollout.task.get('type', 'task')}/{task_index}"


class Planner:
    def __init__(self, cfg: JobConfig, job_id: str, ledger: Ledger, *, seed_step: int = 0) -> None:
        self.cfg, self.job_id, self.ledger = cfg, job_id, ledger
        self.book = GroupBook()
        self.rng = random.Random(cfg.seed * 1_000_003 + seed_step)
        self.version = 0  # the policy version new groups are planned at (the controller's)
        self.staleness_holds = 0  # times a ready step started waiting for a straggler
        self._holding = False

    def plan(self, *, step: int, training: bool) -> list[Assignment]:
        """Plan the groups the window allows; returns their assignments, in order."""
        per_step = self.cfg.trainer.groups_per_step
        in_step = per_step if training else 0
        needed = (self.cfg.trainer.steps - step) * per_step
        limit = self.cfg.rollout.groups_in_flight
        if self.cfg.rollout.pipeline == "sync":
            if training:
                return []
            limit = per_step
        out: list[Assignment] = []
        while self.book.open_groups + in_step < min(limit, needed):
            out += self._plan_group(self.rng.randrange(1 << 30), self.version)
        return out

    def _plan_group(self, index: int, version: int) -> list[Assignment]:
        gid = new_id("g")
        planned = [PlannedRollout(gid, task_id(self.cfg, index)) for _ in range(self.group_size)]
        self.ledger.plan(self.job_id, planned)  # "expected" before anything is dispatched
        self.book.add(gid, index, [p.id for p in planned], version)
        return [Assignment(p.id, gid, index, p.session_id) for p in planned]

    @property
    def group_size(self) -> int:
        return self.cfg.rollout.group_size

    def adopt_parked(self, rows: Sequence[tuple[str, str, str, int | None]]) -> int:
        """A resumed job's scored rollouts (id, group, state, first version), waiting in the
        stream: their groups go back in the book, ready; returns how many groups."""
        by_group: dict[str, list[tuple[str, int | None]]] = {}
        for rid, gid, _state, first in rows:
            by_group.setdefault(gid, []).append((rid, first))
        for gid, members in by_group.items():
            versions = [v for _, v in members if v is not None]
            self.book.add(gid, -1, [r for r, _ in members], min(versions, default=self.version))
            for rid, _ in members:
                self.book.scored(rid)
        return len(by_group)

    def next_batch(self) -> list[Group] | None:
        """The groups of the next step, or None while it must wait (too few ready, or a
        straggler would go stale)."""
        self.book.drop_dead()
        groups = self.book.take_ready(self.cfg.trainer.groups_per_step)
        if len(groups) < self.cfg.trainer.groups_per_step or self._would_strand(self.version):
            self.book.put_back(groups)
            return None
        return groups

    def _would_strand(self, version: int) -> bool:
        """After this step the version is v+1; a group still generating, planned at u, is
        then trained at v+1 or later, which must stay within the staleness bound."""
        oldest = self.book.oldest_unready_version()
        if oldest is None or version + 1 - oldest <= self.cfg.algo.max_staleness:
            self._holding = False
            return False
        self.staleness_holds += 0 if self._holding else 1
        self._holding = True
        return True
