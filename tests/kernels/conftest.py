"""Let the kernel tests run from a bare checkout (GPU machine: torch + pydantic, no install).

`rlsys.kernels` lives in `kernels/` and is mapped by the installed package; when the package
is not installed, map it here from the repository so `python -m pytest tests/kernels` works
with the repository root on PYTHONPATH.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

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
