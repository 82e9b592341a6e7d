"""A stable argsort on the narrowest integer keys that hold the values.

A GPU radix sort makes one pass per key byte, so int64 keys cost eight passes where the
values fit one or four bytes (~11 kernels per MoE layer and micro-batch for the experts'
order before this). A stable sort's order depends only on the keys' values, so the narrow
keys give the same order. Invariant: `keys` are non-negative integers below `bound`.
"""

from __future__ import annotations

import torch
from torch import Tensor


def stable_argsort(keys: Tensor, bound: int) -> Tensor:
    """`torch.argsort(keys, stable=True)` for non-negative integer keys below `bound`."""
    if bound <= 2**8:
        keys = keys.to(torch.uint8)
    elif bound <= 2**31:
        keys = keys.to(torch.int32)
    return torch.argsort(keys, stable=True)
