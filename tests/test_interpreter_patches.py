"""The suite's interpreter speed-up (`tests/interpreter_patches.py`): a launch patches
`triton.language` a bounded number of times, not once per nested call, and computes the
same values."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

if os.environ.get("TRITON_INTERPRET") != "1":  # set by tests/conftest.py on a CPU machine
    pytest.skip("Triton's interpreter is not in use", allow_module_level=True)

from triton.runtime import interpreter  # noqa: E402

PROGRAMS, STEPS = 4, 8


@triton.jit
def _scaled_sum(x, i):
    return tl.sum(x * i, axis=0)


@triton.jit
def _kernel(X, Out, N: tl.constexpr, STEPS: tl.constexpr):
    pid = tl.program_id(0)
    x = tl.load(X + pid * N + tl.arange(0, N))
    acc = 0.0
    for i in range(STEPS):
        acc += _scaled_sum(x, i)  # a nested call, and tl.sum inside it: STEPS times each
    tl.store(Out + pid, acc)


def test_a_launch_patches_the_language_a_bounded_number_of_times(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = []
    original = interpreter._patch_builtin

    def counted(pkg, builder, scope):  # type: ignore[no-untyped-def]
        calls.append(pkg)
        return original(pkg, builder, scope)

    monkeypatch.setattr(interpreter, "_patch_builtin", counted)
    x = torch.arange(PROGRAMS * 16, dtype=torch.float32).reshape(PROGRAMS, 16)
    out = torch.empty(PROGRAMS)
    _kernel[(PROGRAMS,)](x, out, N=16, STEPS=STEPS)
    expected = x.sum(1) * sum(range(STEPS))
    assert torch.equal(out, expected)
    nested = PROGRAMS * STEPS * 2  # _scaled_sum and tl.sum, per program and step
    # the launch's own patch and the first patch of each module set: a handful, not one
    # (three `getmembers` sweeps each) per nested call
    assert len(calls) < nested, len(calls)


def test_the_overflow_sanitizer_is_off_unless_asked_for() -> None:
    # on: every int32 add/sub/mul redone in int64 and range-asserted (43% of a test's time)
    wanted = os.environ.get("RLSYS_TRITON_SANITIZE_OVERFLOW") == "1"
    assert interpreter.interpreter_builder.options.sanitize_overflow is wanted
