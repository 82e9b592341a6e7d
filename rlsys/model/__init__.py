"""The policy model shared by the engine and the trainer (docs/ARCHITECTURE.md, "Numerics").

Public API: `Transformer` (full `forward` and incremental `forward_step` + `ModelCache`),
routing record/replay (`RoutingRecorder`, `RoutingReplay`, `RoutedExperts`), RL log-probs
(`token_log_probs`, `candidate_mask`, `zero_center`), bookkeeping (`AuxLosses`).
"""

from rlsys.model.aux import AuxLosses
from rlsys.model.cache import ModelCache, SlidingKVCache, SparseKVCache
from rlsys.model.logits import candidate_mask, token_log_probs, zero_center
from rlsys.model.routing import RoutedExperts, RoutingRecorder, RoutingReplay
from rlsys.model.transformer import ModelOutput, Transformer

__all__ = [
    "AuxLosses",
    "ModelCache",
    "ModelOutput",
    "RoutedExperts",
    "RoutingRecorder",
    "RoutingReplay",
    "SlidingKVCache",
    "SparseKVCache",
    "Transformer",
    "candidate_mask",
    "token_log_probs",
    "zero_center",
]
