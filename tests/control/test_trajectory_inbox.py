"""The trainer's consumer (`TrajectoryInbox`) over a real SQLite stream: it acks only what
is committed, redelivers what a dead trainer read, and trims the stream as it goes."""

import pickle

import pytest

from rlsys.control.trajectory_inbox import MissingTrajectories, TrajectoryInbox
from rlsys.ledger.stream import StreamConnectionError

pytestmark = pytest.mark.unit


def _publish(stream, ids):
    return stream.publish_many([(r, pickle.dumps({"id": r})) for r in ids])


def test_entries_are_acked_and_trimmed_only_after_commit(stream):
    _publish(stream, ["a", "b", "c"])
    inbox = TrajectoryInbox(stream)
    assert inbox.take(["b", "a"], timeout_s=5) == [{"id": "b"}, {"id": "a"}]
    assert stream.position().pending == 3 and stream.position().length == 3
    assert inbox.commit(["a", "b"]) == 2
    assert stream.position().length == 1  # only what is in flight stays in the stream


def test_a_dead_trainers_unacked_entries_are_delivered_again(stream):
    ids = _publish(stream, ["a", "b", "c", "d"])
    first = TrajectoryInbox(stream)
    first.take(["a", "b", "c"], timeout_s=5)
    # The first trainer's step on a, b was checkpointed; it died before acking; c was read
    # for the next step and never trained.
    second = TrajectoryInbox(stream)
    assert second.resume(committed_entries=ids[:2]) == 2  # c, and d read along with it
    assert second.take(["c", "d"], timeout_s=5) == [{"id": "c"}, {"id": "d"}]
    second.commit(["c", "d"])
    assert stream.position().pending == 0 and stream.position().length == 0


def test_without_resume_a_replaced_trainer_would_miss_the_read_entries(stream):
    # The feature off: a new consumer that does not resume never sees what the dead one read.
    _publish(stream, ["a"])
    TrajectoryInbox(stream).take(["a"], timeout_s=5)
    with pytest.raises(MissingTrajectories):
        TrajectoryInbox(stream).take(["a"], timeout_s=0.1)


def test_entries_of_discarded_rollouts_are_acked_now_or_on_arrival(stream):
    _publish(stream, ["a"])
    inbox = TrajectoryInbox(stream)
    inbox.take(["a"], timeout_s=5)
    assert inbox.discard(["a", "late"]) == 1
    _publish(stream, ["late", "b"])
    inbox.take(["b"], timeout_s=5)
    assert "late" not in inbox.held and stream.position().pending == 1


def test_a_rollout_published_twice_is_held_once_and_acked_once(stream):
    _publish(stream, ["a", "a"])  # a producer's retry: the stream keeps one entry
    inbox = TrajectoryInbox(stream)
    inbox.take(["a"], timeout_s=5)
    inbox._hold(stream.read(inbox.consumer, 10))
    assert inbox.size == 1 and inbox.commit(["a"]) == 1
    assert stream.position().length == 0


class _LostReply:
    """The stream carries out one read, then the connection dies before its reply arrives:
    the entries are delivered (pending on the consumer) but the caller gets an error."""

    def __init__(self, stream) -> None:
        self.stream, self.armed = stream, True

    def __getattr__(self, name):
        return getattr(self.stream, name)

    def read(self, consumer, count=1, block_ms=None):
        delivered = self.stream.read(consumer, count, block_ms)
        if self.armed and delivered:
            self.armed = False
            raise StreamConnectionError("connection lost with the reply")
        return delivered


def test_entries_whose_read_reply_was_lost_are_taken_back_on_the_retried_take(stream):
    _publish(stream, ["a", "b"])
    inbox = TrajectoryInbox(_LostReply(stream))
    with pytest.raises(StreamConnectionError):
        inbox.take(["a", "b"], timeout_s=5)  # the step fails; the controller retries it
    assert inbox.take(["a", "b"], timeout_s=5) == [{"id": "a"}, {"id": "b"}]
    assert inbox.commit(["a", "b"]) == 2  # each entry held once, acked once
    assert stream.position().pending == 0
