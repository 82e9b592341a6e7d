import threading

import pytest

from rlsys.engine.api import GenerationRequest, GenerationResult
from rlsys.rollout.admission import AdmissionScheduler, NoLiveReplica
from rlsys.rollout.client import AdmittedGenerator, ReplicaDead

pytestmark = pytest.mark.unit


def test_session_stays_on_its_replica():
    s = AdmissionScheduler(["a", "b", "c"], max_running=16)
    first = s.acquire("s1", "r1").replica_id
    s.release("r1")
    for turn in range(2, 8):
        s.acquire(f"other{turn}", f"o{turn}")  # load piling up must not move s1
        t = s.acquire("s1", f"r{turn}")
        assert t.granted and t.replica_id == first
        s.release(f"r{turn}")


def test_round_robin_does_not_keep_sessions():
    s = AdmissionScheduler(["a", "b"], policy="round_robin")
    seen = {s.acquire("s1", f"r{i}").replica_id for i in range(4)}
    assert seen == {"a", "b"}


def test_overloaded_request_waits_in_place_fifo_then_is_granted_on_same_replica():
    s = AdmissionScheduler(["a", "b"], max_running=1, max_queue=2)
    assert s.acquire("s1", "r1").granted
    s.session_replica["s2"] = s.session_replica["s3"] = "a"
    w2, w3 = s.acquire("s2", "r2"), s.acquire("s3", "r3")
    assert not w2.granted and w2.queue_position == 0 and w2.replica_id == "a"
    assert not w3.granted and w3.queue_position == 1
    full = (s.session_replica.__setitem__("s4", "a"), s.acquire("s4", "r4"))[1]
    assert not full.granted and full.queue_position is None
    s.release("r1")
    assert not s.acquire("s3", "r3").granted  # not at the head: FIFO holds
    assert s.acquire("s2", "r2", attempt=1).granted
    assert s.acquire("s2", "r2").replica_id == "a"


def test_backoff_grows_and_is_capped():
    s = AdmissionScheduler(["a"], max_running=1, backoff_s=0.01, max_backoff_s=0.05)
    s.acquire("s0", "r0")
    delays = [s.acquire("s1", "r1", attempt=k).retry_after_s for k in range(5)]
    assert delays == [0.01, 0.02, 0.04, 0.05, 0.05]


def test_session_migrates_only_when_its_replica_dies():
    s = AdmissionScheduler(["a", "b"])
    home = s.acquire("s1", "r1").replica_id
    s.release("r1")
    s.mark_dead(home)
    t = s.acquire("s1", "r2")
    assert t.granted and t.replica_id != home and t.migrated_from == home
    s.mark_dead(t.replica_id)
    with pytest.raises(NoLiveReplica):
        s.acquire("s1", "r3")


def test_release_without_a_grant_is_an_error():
    s = AdmissionScheduler(["a"])
    with pytest.raises(KeyError):
        s.release("never")


class Replica:
    """A fake engine replica at the outer edge: echoes, can die, can be slow."""

    def __init__(self, name, dead=False, gate=None):
        self.name, self.dead, self.gate, self.calls = name, dead, gate, 0

    def generate(self, request):
        self.calls += 1
        if self.dead:
            raise ReplicaDead(f"{self.name} is gone")
        if self.gate:
            self.gate.wait(5)
        return GenerationResult(request.request_id, token_ids=[1, 2], logprobs=[-0.1, -0.2])


def test_client_records_wait_retry_and_migration_events():
    sched = AdmissionScheduler(["a", "b"], max_running=1, backoff_s=0.001)
    gate = threading.Event()
    replicas = {"a": Replica("a", gate=gate), "b": Replica("b", gate=gate)}
    events = []
    client = AdmittedGenerator(sched, replicas, lambda kind, data: events.append((kind, data)))
    sched.session_replica["s2"] = "a"
    blocker = threading.Thread(target=client.generate, args=(GenerationRequest("r1", "s1", [5]),))
    sched.session_replica["s1"] = "a"
    blocker.start()
    while not sched.replicas["a"].running:
        pass
    threading.Timer(0.05, gate.set).start()
    out = client.generate(GenerationRequest("r2", "s2", [5]))
    blocker.join()
    assert out.token_ids == [1, 2]
    kinds = [k for k, _ in events]
    assert kinds == ["admission_wait", "admission_retry"]
    assert events[1][1]["replica"] == "a" and events[1][1]["retries"] >= 1

    events.clear()
    replicas["a"].dead = True
    out = client.generate(GenerationRequest("r3", "s2", [5]))
    assert out.token_ids == [1, 2]
    assert [k for k, _ in events] == ["replica_dead", "migration"]
    assert events[1][1] == {"from": "a", "to": "b"}
    assert sched.snapshot()["b"]["running"] == 0


def test_a_dead_workers_sessions_give_their_slots_back():
    s = AdmissionScheduler(["a"], max_running=1)
    assert s.acquire("s1", "r1").granted
    assert not s.acquire("s2", "r2").granted
    assert s.cancel_sessions(["s1"]) == 1
    assert s.acquire("s2", "r2").granted
