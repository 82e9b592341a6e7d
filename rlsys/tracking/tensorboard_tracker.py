"""TensorBoard event files, written as the job runs (what `rlsys monitor --tensorboard`
writes after the fact, from the ledger): the series per step, the resolved config and the
ledger's final stats as text, the final numbers as scalars at the last step."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rlsys.config.tracking import TensorboardTracking
from rlsys.tracking.base import RunInfo


class TensorboardTracker:
    def __init__(self, writer: Any) -> None:
        self.writer = writer
        self.last_step = 0

    @classmethod
    def open(cls, cfg: TensorboardTracking, info: RunInfo) -> TensorboardTracker:
        from tensorboardX import SummaryWriter

        writer = SummaryWriter(str(Path(cfg.dir) if cfg.dir else info.run_dir / "tensorboard"))
        writer.add_text("config", _code_block(info.config), 0)
        return cls(writer)

    def log_step(self, step: int, values: Mapping[str, float]) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)
        self.last_step = step

    def finish(self, status: str, final: Mapping[str, float], stats: Mapping[str, Any]) -> None:
        for name, value in final.items():
            self.writer.add_scalar(name, value, self.last_step)
        self.writer.add_text("ledger_stats", _code_block(dict(stats)), self.last_step)
        self.writer.close()


def _code_block(data: dict[str, Any]) -> str:
    # TensorBoard renders text as markdown: indent by four spaces to keep the JSON as is
    return "\n".join("    " + line for line in json.dumps(data, indent=2).splitlines())
