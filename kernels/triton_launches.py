"""A hook around every Triton kernel launch, compiled or interpreted (measurement only).

`benchmarks/kernel_count.py` counts the kernels a forward launches; Triton's launches do
not pass through torch's dispatcher, so they are caught here, where Triton is owned. The
hook is installed for the `with` block only and removed after it, whatever happens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

# on_launch(kernel name, is a real launch (not a warm-up compile), the launch itself):
# must call the launch once and return what it returns
LaunchHook = Callable[[str, bool, Callable[[], Any]], Any]


@contextlib.contextmanager
def hooked_triton_launches(on_launch: LaunchHook) -> Iterator[None]:
    """Route every Triton launch inside the block through `on_launch`; a no-op without Triton."""
    patched = []
    try:
        import triton.runtime.interpreter as interp
        import triton.runtime.jit as jit

        for cls in (jit.JITFunction, interp.InterpretedFunction):
            original = cls.run

            def run(self, *args, _original=original, **kwargs):  # type: ignore[no-untyped-def]
                launch = lambda: _original(self, *args, **kwargs)  # noqa: E731
                return on_launch(self.__name__, not kwargs.get("warmup", False), launch)

            cls.run = run  # type: ignore[method-assign]
            patched.append((cls, original))
    except ImportError:
        pass
    try:
        yield
    finally:
        for cls, original in patched:
            cls.run = original  # type: ignore[method-assign]
