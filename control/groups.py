"""Group bookkeeping for the controller: which rollouts belong to a group, which finished.

A group is ready for the trainer when every member still expected has a scored
trajectory in hand. A failed member leaves the group (its failure is in the ledger); a
retried member is replaced by its retry. The book holds rollout ids only: trajectories wait
in the stream. Pure Python, no Ray: unit-testable.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Group:
    group_id: str
    task_index: int
    members: set[str] = field(default_factory=set)
    planned_version: int = 0  # policy version when planned: its tokens are this or newer
    scored: set[str] = field(default_factory=set)  # members whose trajectory is in the stream
    rewards: dict[str, float] = field(default_factory=dict)  # scored member -> its reward
    penalised: set[str] = field(default_factory=set)  # scored members with a penalised turn
    sifted: bool = False  # judged to carry a learning signal (or adopted on a resume)

    @property
    def ready(self) -> bool:
        return bool(self.members) and self.members <= set(self.scored)

    @property
    def dead(self) -> bool:
        """Every member failed: nothing to train, nothing to wait for."""
        return not self.members


class GroupBook:
    def __init__(self) -> None:
        self.groups: dict[str, Group] = {}
        self.group_of: dict[str, str] = {}

    def add(self, group_id: str, task_index: int, rollout_ids: list[str], version: int = 0) -> None:
        self.groups[group_id] = Group(
            group_id, task_index, set(rollout_ids), planned_version=version
        )
        for rid in rollout_ids:
            self.group_of[rid] = group_id

    def scored(self, rid: str, reward: float | None = None, penalised: bool = False) -> None:
        group = self.groups.get(self.group_of.get(rid, ""))
        if group is not None and rid in group.members:
            group.scored.add(rid)
            if reward is not None:
                group.rewards[rid] = reward
            if penalised:
                group.penalised.add(rid)

    def failed(self, rid: str, retry_id: str | None = None) -> None:
        group = self.groups.get(self.group_of[rid])
        if group is None:
            return  # its group was already trained or dropped
        group.members.discard(rid)
        if retry_id:
            group.members.add(retry_id)
            self.group_of[retry_id] = group.group_id

    def unsifted_ready(self) -> list[Group]:
        """Ready groups not yet judged for their learning signal."""
        return [g for g in self.groups.values() if g.ready and not g.sifted]

    def remove(self, group: Group) -> None:
        del self.groups[group.group_id]

    def take_ready(self, limit: int) -> list[Group]:
        ready = [g for g in self.groups.values() if g.ready and g.sifted][:limit]
        for g in ready:
            del self.groups[g.group_id]
        return ready

    def put_back(self, groups: list[Group]) -> None:
        """Return taken groups, keeping planning order (oldest planned version first)."""
        for g in groups:
            self.groups[g.group_id] = g
        self.groups = dict(sorted(self.groups.items(), key=lambda kv: kv[1].planned_version))

    def drop_dead(self) -> int:
        dead = [gid for gid, g in self.groups.items() if g.dead]
        for gid in dead:
            del self.groups[gid]
        return len(dead)

    def oldest_open_version(self) -> int | None:
        """The planned version of the oldest open group (None if none is open)."""
        versions = [g.planned_version for g in self.groups.values() if not g.dead]
        return min(versions) if versions else None

    def oldest_unready_version(self) -> int | None:
        """The planned version of the oldest group still generating (None if none is)."""
        versions = [g.planned_version for g in self.groups.values() if not g.ready and not g.dead]
        return min(versions) if versions else None

    @property
    def open_groups(self) -> int:
        return len(self.groups)
