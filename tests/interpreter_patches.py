"""Triton's interpreter, without re-patching `triton.language` at every device-function call.

The CPU suite runs the Triton kernels through Triton's interpreter (`TRITON_INTERPRET=1`).
Before a launch the interpreter swaps `triton.language`'s builtins for interpreted ones
(`_patch_lang`: `inspect.getmembers` over `tl`, `tl.tensor`, `tl.math`, then ~30 more
attributes) and restores them after. It does the same again at *every* call of a nested
`@triton.jit` function (our helpers, and `tl.sum`, `tl.max`, ...), once per program of the
grid and per loop iteration: a profile of the interpreter tests put ~23% of their time
there.

It also turns off the interpreter's integer-overflow sanitizer (`sanitize_overflow`, on by
default in the interpreter only; compiled kernels run without it unless debugging): it
redoes every int32 add, sub and mul in int64 and asserts the range, 43% of an interpreter
test's time in a profile, and at the CPU tests' shapes (indices in the thousands) it cannot
fire. `RLSYS_TRITON_SANITIZE_OVERFLOW=1` keeps it on.

Invariant kept: inside one launch, `_patch_lang(fn)` depends on `fn` only through which of
`tl` / `tl.core` its globals hold, and nothing undoes a patch before the launch ends. So a
call whose modules were all patched earlier in the same launch is skipped, and every other
call runs Triton's own `_patch_lang` unchanged: the interpreted kernels compute exactly
what they computed before. Where Triton's internals differ from what this expects, nothing
is changed (the suite is only slower).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any


def install() -> bool:
    """Wrap the interpreter's launch and `_patch_lang`; True if installed."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    launch = getattr(interpreter, "GridExecutor", None)
    original = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if launch is None or original is None or scope_type is None:
        return False
    if getattr(original, "_rlsys_cached", False):
        return True
    state: dict[str, Any] = {"depth": 0, "patched": set()}

    def _langs(fn: Any) -> frozenset[int]:
        return frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)

    def patch_lang(fn: Any) -> Any:
        langs = _langs(fn)
        if state["depth"] and langs and langs <= state["patched"]:
            return scope_type()  # already in effect for this launch: nothing to restore
        scope = original(fn)
        if state["depth"]:
            state["patched"] |= langs
        return scope

    launch_call = launch.__call__

    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if state["depth"] == 0:  # a new launch: nothing of it is patched yet
            state["patched"] = set()
        state["depth"] += 1
        try:
            return launch_call(self, *args, **kwargs)
        finally:
            state["depth"] -= 1

    if os.environ.get("RLSYS_TRITON_SANITIZE_OVERFLOW") != "1":
        builder = interpreter.interpreter_builder
        if dataclasses.is_dataclass(builder.options) and hasattr(
            builder.options, "sanitize_overflow"
        ):
            builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)
    patch_lang._rlsys_cached = True  # type: ignore[attr-defined]
    interpreter._patch_lang = patch_lang
    launch.__call__ = call
    return True


install()
