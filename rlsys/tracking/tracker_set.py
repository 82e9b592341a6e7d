"""Every tracker a job configured, fed together.

Invariants: all trackers are opened before the job's actors start (a bad URI or a missing
package fails the job at once); after that, a tracker that raises is reported once and
gets nothing more, while the job and the other trackers go on (a tracking outage must not
end an RL run); `finish` is called at most once per tracker.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rlsys.tracking.base import RunInfo, Tracker
from rlsys.tracking.registry import TRACKERS
from rlsys.tracking.series import final_values, step_values


class TrackerSet:
    def __init__(self, trackers: dict[str, Tracker], on_event: Callable[[str], None]) -> None:
        self.trackers, self.on_event = trackers, on_event

    @classmethod
    def open(
        cls, configs: Sequence[Any], info: RunInfo, on_event: Callable[[str], None]
    ) -> TrackerSet:
        opened = cls({}, on_event)
        try:
            for i, cfg in enumerate(configs):
                opened.trackers[f"tracking[{i}] ({cfg.type})"] = TRACKERS[cfg.type](cfg, info)
        except BaseException:
            opened.finish({"job_status": "failed"})
            raise
        return opened

    def log_step(self, metrics: Mapping[str, Any]) -> None:
        values = step_values(metrics)
        for name, tracker in list(self.trackers.items()):
            self._guard(name, lambda t=tracker: t.log_step(int(metrics["step"]), values))

    def finish(self, stats: Mapping[str, Any]) -> None:
        status, final = str(stats.get("job_status")), final_values(stats)
        trackers, self.trackers = self.trackers, {}
        for name, tracker in trackers.items():
            self._guard(name, lambda t=tracker: t.finish(status, final, stats), final=True)

    def _guard(self, name: str, call: Callable[[], None], final: bool = False) -> None:
        try:
            call()
        except Exception as err:  # noqa: BLE001 - see the module docstring
            self.trackers.pop(name, None)
            what = "could not close its run" if final else "failed and is dropped"
            self.on_event(f"{name} {what}: {type(err).__name__}: {err}")
