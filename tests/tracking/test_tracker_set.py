"""A tracker that fails mid-job is reported and dropped; the others keep recording."""

import pytest

from rlsys.config.tracking import TensorboardTracking
from rlsys.tracking.base import RunInfo
from rlsys.tracking.tensorboard_tracker import TensorboardTracker
from rlsys.tracking.tracker_set import TrackerSet
from tests.tracking.readers import tensorboard_scalars

pytestmark = pytest.mark.unit


class _Outage:
    """A tracker whose service went away (the outer edge: a remote tracking server)."""

    def log_step(self, step, values):
        raise ConnectionError("tracking server unreachable")

    def finish(self, status, final, stats):
        raise AssertionError("a dropped tracker is not finished")


def test_a_failing_tracker_is_dropped_and_the_others_go_on(tmp_path):
    info = RunInfo(job_id="j-1", name="t", config={"seed": 0}, run_dir=tmp_path)
    board = TensorboardTracker.open(TensorboardTracking(type="tensorboard"), info)
    events: list[str] = []
    trackers = TrackerSet({"outage": _Outage(), "board": board}, events.append)
    for step in (1, 2):
        trackers.log_step({"step": step, "policy_version": step, "reward_mean": 0.5 * step})
    trackers.finish({"job_status": "completed", "expected": 8, "terminal": {"trained": 8}})
    assert len(events) == 1 and "outage failed and is dropped" in events[0]
    scalars = tensorboard_scalars(tmp_path / "tensorboard")
    assert scalars["reward_mean"] == {1: 0.5, 2: 1.0}
    assert scalars["ledger/terminal/trained"] == {2: 8.0}
