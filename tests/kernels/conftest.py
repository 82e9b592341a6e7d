"""Let the kernel tests run from a bare checkout (GPU machine: torch + pydantic, no install).

`rlsys.kernels` lives in `kernels/` and is mapped by the installed package; when the package
is not installed, map it here from the repository so `python -m pytest tests/kernels` works
with the repository root on PYTHONPATH.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

try:
    import rlsys.kernels  # noqa: F401
except ModuleNotFoundError:
    _root = Path(__file__).resolve().parents[2] / "kernels"
    _spec = importlib.util.spec_from_file_location(
        "rlsys.kernels", _root / "__init__.py", submodule_search_locations=[str(_root)]
    )
    assert _spec is not None and _spec.loader is not None
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["rlsys.kernels"] = _module
    _spec.loader.exec_module(_module)


@pytest.fixture(params=["exact", "lazy"])
def rescale_rule(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both online-softmax rules of `attention_fwd.fold_step`: the exact running maximum
    (head dims below `LAZY_RESCALE_MIN_DIM`) and the slack reference with the rescale on
    demand (from it). Under the interpreter the lazy rule is forced down to these tests'
    small heads; a GPU compile fixes the rule by the head dim, and `test_triton_cuda`
    runs the lazy one at head dim 128."""
    if request.param == "lazy":
        from rlsys.kernels.triton_ops import attention_fwd
        from rlsys.kernels.triton_ops.common import interpreting

        if not interpreting():
            pytest.skip("a compiled kernel's rule is fixed by its head dim")
        import triton.language as tl

        monkeypatch.setattr(attention_fwd, "LAZY_RESCALE_MIN_DIM", tl.constexpr(0))
    return request.param
