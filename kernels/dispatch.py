"""Which implementation a kernel call runs: Triton on CUDA tensors, the plain-torch
reference on the CPU (docs/ARCHITECTURE.md, "Numerics").

`RLSYS_KERNELS=triton` also routes CPU tensors to the Triton kernels; with
`TRITON_INTERPRET=1` they then run through Triton's interpreter (how CI tests them).
Invariant: importing this module does not import triton; `triton_ops` is imported at the
first call that needs it.
"""

from __future__ import annotations

import os

from torch import Tensor

# cuBLAS without a workspace cannot split K over thread blocks, which is what makes its
# bf16 products batch-invariant (`rlsys.kernels.triton_ops.products`). Read by torch when it
# first creates a cuBLAS workspace, so set at import, before the model's first CUDA product;
# a value already in the environment wins (and then `products` keeps those products on the
# Triton kernels). Not in the `plain` linear mode (a benchmark's ceiling: cuBLAS as it is).
WORKSPACE_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":0:0", "CUBLASLT_WORKSPACE_SIZE": "0"}
if os.environ.get("RLSYS_LINEAR") != "plain":
    for _key, _value in WORKSPACE_ENV.items():
        os.environ.setdefault(_key, _value)


def use_triton(t: Tensor) -> bool:
    """True when a call on `t` must run the Triton kernels."""
    return t.is_cuda or os.environ.get("RLSYS_KERNELS") == "triton"
