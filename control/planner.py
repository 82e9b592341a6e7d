"""Planning, sifting and the staleness gate: which groups exist, which carry a signal, and
when a step may start.

Invariants:
- a group's rollouts are written to the ledger as `planned` before any is handed out;
- at most `rollout.groups_in_flight` groups are open (planned and not yet trained), the
  groups being trained included; only what the remaining steps can consume is planned;
- in `sync` mode nothing is planned while the trainer steps, and one step's groups at a
  time, so every sample comes from the newest weights;
- a finished group is sifted before it is offered to the trainer: one without a learning
  signal (`group_has_signal`) leaves the book at once, for the controller to end it
  `filtered_zero_variance`, and planning replaces it, so a step trains
  `trainer.groups_per_step` informative groups; a group whose members' rewards are not all
  known (a worker died after scoring one) is left for the trainer's own filter;
- at most `algo.max_generation_per_step` groups are judged per step: past it the step
  trains the informative groups it has, and with none the job ends (`JobEnd`), `completed`
  when the task is solved, else `failed` with the reason;
- a step that would push a group still generating past `algo.max_staleness` waits for
  it (a straggler is held for, not thrown away); a ready group left over is never waited
  for (it cannot get fresher), so the job cannot stall on the gate.
With the validated window (groups_in_flight <= groups_per_step * (max_staleness + 1)) the
oldest open group is always trainable before it goes stale. No Ray: unit-tested.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence

from rlsys.algo.filters import group_has_signal, zero_variance_reason
from rlsys.config.job import JobConfig
from rlsys.control.generation import GenerationWindow
from rlsys.control.groups import Group, GroupBook
from rlsys.control.job_end import JobEnd
from rlsys.control.messages import Assignment, RolloutReport
from rlsys.control.task_profiles import TaskProfiles
from rlsys.ledger.records import PlannedRollout, new_id
from rlsys.ledger.store import Ledger

GENERATION_BOUND_FACTOR = 16  # default algo.max_generation_per_step, x groups_per_step


def task_id(cfg: JobConfig, task_index: int) -> str:
    return f"{cfg.rollout.task.get('type', 'task')}/{task_index}"


def task_index_of(task: str) -> int | None:
    """The instance index in a ledger task id (`arithmetic/17` -> 17)."""
    tail = task.rpartition("/")[2]
    return int(tail) if tail.lstrip("-").isdigit() else None


class Planner:
    def __init__(
        self,
        cfg: JobConfig,
        job_id: str,
        ledger: Ledger,
        *,
        seed_step: int = 0,
        history: Iterable[tuple[int, float]] = (),
    ) -> None:
        self.cfg, self.job_id, self.ledger = cfg, job_id, ledger
        self.book = GroupBook()
        self.rng = random.Random(cfg.seed * 1_000_003 + seed_step)
        self.profiles = TaskProfiles.from_history(
            cfg.rollout.curriculum, cfg.rollout.group_size, self.rng, history
        )
        self.version = 0  # the policy version new groups are planned at (the controller's)
        self.step = seed_step  # the step the groups being gathered are for, minus one
        self.staleness_holds = 0  # times a ready step started waiting for a straggler
        self.window = GenerationWindow()  # the step being gathered
        self.closed = GenerationWindow()  # the step last handed to the trainer
        self._holding = False

    @property
    def generation_bound(self) -> int:
        bound = self.cfg.algo.max_generation_per_step
        return bound or GENERATION_BOUND_FACTOR * self.cfg.trainer.groups_per_step

    def plan(self, *, step: int, training: bool) -> list[Assignment]:
        """Plan the groups the window allows; returns their assignments, in order."""
        self.step = step
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
            out += self._plan_group(self.profiles.draw(), self.version)
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

    def scored(self, report: RolloutReport) -> None:
        """A worker scored a rollout: its group, its prompt's profile, the step's window."""
        self.book.scored(report.rollout_id, report.reward, report.penalised)
        if report.reward is None:
            return
        self.window.rollouts_scored += 1
        self.window.rewards.append(report.reward)
        group = self.book.groups.get(self.book.group_of.get(report.rollout_id, ""))
        if group is not None and group.task_index >= 0:
            self.profiles.record(group.task_index, report.reward)

    def failed(self) -> None:
        self.window.rollouts_failed += 1

    def sift(self) -> list[tuple[Group, str]]:
        """Judge every newly finished group; those without a learning signal leave the book
        and are returned with the reason, for the controller to end them."""
        out = []
        for group in self.book.unsifted_ready():
            members = sorted(group.members)
            rewards = [group.rewards.get(m) for m in members]
            known = [r for r in rewards if r is not None]
            penalised = [m in group.penalised for m in members]
            judged = self.cfg.algo.filter_zero_variance and len(known) == len(members)
            if judged and not group_has_signal(known, penalised):
                self.book.remove(group)
                self.window.groups += 1
                self.window.zero_variance_groups += 1
                self.window.zero_variance_rollouts += len(members)
                out.append((group, zero_variance_reason(known)))
            else:
                group.sifted = True
                self.window.groups += 1
        return out

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
            self.book.groups[gid].sifted = True  # the trainer's filter judges these
        return len(by_group)

    def next_batch(self) -> list[Group] | None:
        """The groups of the next step, or None while it must wait (too few ready, or a
        straggler would go stale). Past the generation bound a short batch goes ahead;
        with nothing to train, `JobEnd`."""
        self.book.drop_dead()
        per_step = self.cfg.trainer.groups_per_step
        groups = self.book.take_ready(per_step)
        if len(groups) < per_step and self.window.groups < self.generation_bound:
            self.book.put_back(groups)
            return None
        if not groups:
            self.raise_no_signal()
        if self._would_strand(self.version):
            self.book.put_back(groups)
            return None
        self.closed, self.window = self.window, GenerationWindow()
        return groups

    def raise_no_signal(self) -> None:
        """Nothing to train after the bound: solved, or no learning signal."""
        self.raise_if_solved()
        w = self.window
        values = sorted(set(w.rewards))
        passing = self.cfg.rollout.curriculum.pass_reward
        if values and values[-1] < passing:
            verdict = "no rollout passed: the task is out of this policy's reach"
        elif values and values[0] >= passing:
            verdict = "every rollout passed: the policy has solved these prompts"
        else:
            verdict = "each group agreed within itself"
        shown = ", ".join(f"{v:g}" for v in values[:4]) + (", ..." if len(values) > 4 else "")
        raise JobEnd(
            "failed",
            f"no learning signal: {w.groups} groups generated for step {self.step + 1} "
            f"(algo.max_generation_per_step {self.generation_bound}) all had equal rewards "
            f"(rewards seen: {shown or 'none'}); {verdict}",
        )

    def raise_if_solved(self) -> None:
        if self.profiles.solved():
            rate = self.profiles.pass_rate()
            goal = self.cfg.rollout.curriculum.solved_pass_rate
            scope = (
                f"{self.cfg.rollout.curriculum.task_set} prompts"
                if self.profiles.bounded
                else f"the last {self.cfg.rollout.curriculum.solved_window} rollouts"
            )
            raise JobEnd("completed", f"solved: pass rate {rate:.3f} >= {goal} over {scope}")

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
