"""A kernel for the offline compiler's own tests: a defaulted constexpr that picks a branch.

Compiled, never launched (`kernels/triton_ops/offline.py` imports it by name in a child)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def branchy(X, HEAVY: tl.constexpr = False):
    """Loads 128 floats and stores them back, through eight rounds of exp and sin when HEAVY:
    compiled with HEAVY at its default, the heavy branch is gone."""
    i = tl.arange(0, 128)
    x = tl.load(X + i)
    if HEAVY:
        for _ in tl.static_range(8):
            x = tl.exp(x) * tl.sin(x)
    tl.store(X + i, x)
