"""The trainer: trajectories in, optimiser steps out, no Ray (docs/ARCHITECTURE.md, "One
step of data flow" and "Numerics").

Public API: `Trainer` (`train_step`, `log_probs`, `pretrain_critic`, `save_checkpoint`,
`restore`), `StepResult`/`StepMetrics`, `supervised_warm_start`, the replay registry
`REPLAY_MODES`, and the shared log-prob recipe (`masked_log_softmax`, `allowed_mask`).
"""

from rlsys.trainer.checkpoint import load_checkpoint, save_checkpoint
from rlsys.trainer.forward import REPLAY_MODES
from rlsys.trainer.logprobs import LogProbOptions, allowed_mask, masked_log_softmax
from rlsys.trainer.metrics import StepMetrics
from rlsys.trainer.trainer import StepResult, Trainer
from rlsys.trainer.warm_start import supervised_warm_start

__all__ = [
    "REPLAY_MODES",
    "LogProbOptions",
    "StepMetrics",
    "StepResult",
    "Trainer",
    "allowed_mask",
    "load_checkpoint",
    "masked_log_softmax",
    "save_checkpoint",
    "supervised_warm_start",
]
