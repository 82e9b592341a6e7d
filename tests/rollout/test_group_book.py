"""The controller's group bookkeeping: readiness, failures, retries, and the oldest open
group (what the staleness gate protects)."""

import pytest

from rlsys.control.groups import GroupBook

pytestmark = pytest.mark.unit


def _sift(book: GroupBook) -> None:
    for group in book.unsifted_ready():  # as `Planner.sift` marks a group with a signal
        group.sifted = True


def test_ready_groups_come_out_oldest_first_and_stragglers_are_tracked():
    book = GroupBook()
    book.add("g0", 0, ["a", "b"], version=0)
    book.add("g1", 1, ["c", "d"], version=1)
    book.add("g2", 2, ["e"], version=2)
    assert book.oldest_open_version() == 0
    for rid in ("c", "d", "e"):
        book.scored(rid)
    book.scored("a")
    assert book.oldest_open_version() == 0  # g0 still waits for "b"
    assert book.take_ready(5) == []  # ready, but not yet judged for a learning signal
    assert [g.group_id for g in book.unsifted_ready()] == ["g1", "g2"]
    _sift(book)
    assert [g.group_id for g in book.take_ready(5)] == ["g1", "g2"]
    book.failed("b", retry_id="b2")  # a lost member is replaced by its retry
    assert book.oldest_open_version() == 0 and not book.groups["g0"].ready
    book.scored("b2")
    _sift(book)
    assert [g.group_id for g in book.take_ready(1)] == ["g0"]
    assert book.oldest_open_version() is None


def test_a_group_whose_members_all_failed_is_dead_not_a_straggler():
    book = GroupBook()
    book.add("g0", 0, ["a"], version=3)
    book.failed("a")
    assert book.oldest_open_version() is None
    assert book.drop_dead() == 1 and book.open_groups == 0


def test_only_groups_still_generating_count_as_stragglers():
    book = GroupBook()
    book.add("old", 0, ["a"], version=0)
    book.add("new", 1, ["b"], version=2)
    assert book.oldest_unready_version() == 0 and book.oldest_open_version() == 0
    book.scored("a")  # ready: waiting cannot make it fresher
    assert book.oldest_unready_version() == 2 and book.oldest_open_version() == 0
