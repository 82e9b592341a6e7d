"""Which implementation a kernel call runs: Triton on CUDA tensors, the plain-torch
reference on the CPU (DESIGN.md 7).

`RLSYS_KERNELS=triton` also routes CPU tensors to the Triton kernels; with
`TRITON_INTERPRET=1` they then run through Triton's interpreter (how CI tests them).
Invariant: importing this module does not import triton; `triton_ops` is imported at the
first call that needs it.
"""

from __future__ import annotations

import os

from torch import Tensor


def use_triton(t: Tensor) -> bool:
    """True when a call on `t` must run the Triton kernels."""
    return t.is_cuda or os.environ.get("RLSYS_KERNELS") == "triton"
