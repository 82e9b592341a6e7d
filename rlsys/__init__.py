"""rlsys: asynchronous agentic RL on Ray, with a lifecycle ledger for every rollout.

The distribution maps the top-level folders `ledger/`, `actors/`, `control/`, `sandboxes/`
and `kernels/` to `rlsys.ledger`, `rlsys.actors`, ... (docs/ARCHITECTURE.md, "Layout"). An installed
package resolves them through that mapping; a bare source checkout on `sys.path` (what a
Ray Jobs `working_dir` ships to a cluster) resolves them here, by adding the checkout's
root to this package's search path.
"""

from pathlib import Path as _Path

_root = _Path(__file__).resolve().parent.parent
if (_root / "ledger" / "__init__.py").is_file() and str(_root) not in __path__:
    __path__.append(str(_root))
