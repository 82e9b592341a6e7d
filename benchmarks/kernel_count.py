"""Count the kernels a forward launches, on any device (the CPU under Triton's interpreter).

Each aten op that would launch a CUDA kernel counts one (views, allocations without a fill,
and host-side scalar reads do not); each Triton kernel launch counts one. On the CPU this
approximates the GPU's count: multi-kernel CUDA ops (radix sort, cumsum, top-k) count
once here, so the GPU profiler (`benchmarks/profile_decode_gpu.py`) stays the authority;
this counter is what tests and CPU development use to see a change in launches.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

from rlsys.kernels.triton_launches import hooked_triton_launches

_FREE = {
    "empty.memory_format",
    "empty_strided.default",
    "empty_like.default",
    "detach.default",
    "lift_fresh.default",
    "_local_scalar_dense.default",
    "set_.source_Storage_storage_offset",
    "is_same_size.default",
    "sym_size.int",
    "sym_stride.int",
    "sym_numel.default",
    "sym_storage_offset.default",
    "resize_.default",
    "_has_compatible_shallow_copy_type.default",
}


@dataclass
class Launches:
    """Kernel launches by name (aten op or Triton kernel)."""

    by_name: Counter[str] = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return sum(self.by_name.values())

    def table(self, top: int = 30) -> str:
        return "\n".join(f"{n:7d}  {name}" for name, n in self.by_name.most_common(top))


class _Mode(TorchDispatchMode):
    def __init__(self, launches: Launches) -> None:
        super().__init__()
        self.launches, self.paused = launches, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = f"{func._schema.name.split('::')[-1]}.{func._overloadname}"
        if not self.paused and not func.is_view and name not in _FREE:
            self.launches.by_name[f"aten.{name}"] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def count_launches() -> Iterator[Launches]:
    """Count kernel launches inside the block (see module doc)."""
    launches = Launches()
    mode = _Mode(launches)

    def on_launch(name: str, real: bool, launch: Callable[[], Any]) -> Any:
        if real:
            launches.by_name[f"triton.{name}"] += 1
        mode.paused += 1  # the launch's own host work is not a kernel
        try:
            return launch()
        finally:
            mode.paused -= 1

    with hooked_triton_launches(on_launch), mode:
        yield launches
