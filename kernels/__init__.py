"""Kernels: the one place where the model's reductions are implemented.

The model calls only the names re-exported here. Today they are the plain-torch,
batch-invariant reference kernels of `rlsys.kernels.reference`; a faster implementation
(Triton, fused CPU) replaces a name here and must pass tests/kernels against the reference.
Invariant: importing this package imports torch only (no triton unless a Triton kernel is
selected, no ray/redis/sqlalchemy).
"""

from rlsys.kernels.reference import (
    block_attention,
    linear,
    log_softmax,
    matmul_nt,
    moe_combine,
    normalize_rows,
    rms_norm,
    sequential_sum,
    sigmoid,
    silu,
)

__all__ = [
    "block_attention",
    "linear",
    "log_softmax",
    "matmul_nt",
    "moe_combine",
    "normalize_rows",
    "rms_norm",
    "sequential_sum",
    "sigmoid",
    "silu",
]
