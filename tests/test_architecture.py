"""The dependency rule of docs/ARCHITECTURE.md ("Dependency rule"), enforced.

Three checks: (1) a static scan of every import statement, so a forbidden import is caught
even inside a function body; (2) the same scan against `ALLOWED_EDGES`, the table of which
of the project's own packages may import which (an edge outside it fails); (3) each package
imported in a fresh interpreter, asserting the forbidden modules are absent from
`sys.modules` (catches transitive pulls).
"""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
# source folder -> import name (docs/ARCHITECTURE.md, "Layout")
PACKAGES = {
    "rlsys": "rlsys",
    "actors": "rlsys.actors",
    "control": "rlsys.control",
    "ledger": "rlsys.ledger",
    "sandboxes": "rlsys.sandboxes",
    "kernels": "rlsys.kernels",
}

# Third-party module -> where it may be imported (path prefixes relative to the repo root).
OWNERS = {
    "ray": ("actors/", "rlsys/cli/"),  # never control/: the control core has no Ray in it
    "sqlalchemy": ("ledger/",),
    "alembic": ("ledger/",),
    "redis": ("ledger/",),
    "triton": ("kernels/",),
    "docker": ("sandboxes/docker",),
    "wandb": ("rlsys/tracking/",),
    "mlflow": ("rlsys/tracking/",),
    # optional (rlsys[vllm]): imported lazily, by the vLLM backend and the HF policy model
    "vllm": ("rlsys/engine/vllm_engine.py",),
    "transformers": ("rlsys/model/hf_",),
}

# The project's own packages (`rlsys.X`, whatever folder holds it) -> the packages it may
# import (docs/ARCHITECTURE.md, "Dependency rule"): cli -> actors -> control -> ledger;
# actors -> rollout -> sandboxes; actors -> engine, trainer, model -> kernels; actors,
# trainer -> algo; everything -> types, config. Leaf modules of `rlsys` (types, tokenizer,
# trajectory, route_rows, candidate_rows) count as packages.
ALLOWED_EDGES: dict[str, set[str]] = {
    # cli -> rollout: the one job loader validates the sections the rollout layer owns
    # (task, sandbox, scaffold) with that layer's schemas (rlsys.rollout.job_sections)
    "rlsys.cli": {"rlsys.actors", "rlsys.config", "rlsys.engine", "rlsys.ledger",
                  "rlsys.model", "rlsys.rollout", "rlsys.sandboxes", "rlsys.tracking",
                  "rlsys.trainer", "rlsys.types"},
    "rlsys.actors": {"rlsys.algo", "rlsys.config", "rlsys.control", "rlsys.engine",
                     "rlsys.ledger", "rlsys.model", "rlsys.rollout", "rlsys.sandboxes",
                     "rlsys.tokenizer", "rlsys.trainer", "rlsys.trajectory", "rlsys.types"},
    # The control core: no actor, engine, trainer or model (so no Ray, no torch).
    "rlsys.control": {"rlsys.algo.filters", "rlsys.config", "rlsys.ledger", "rlsys.tracking",
                      "rlsys.types"},
    "rlsys.rollout": {"rlsys.config", "rlsys.engine.api", "rlsys.sandboxes", "rlsys.tokenizer",
                      "rlsys.trajectory", "rlsys.types"},
    "rlsys.sandboxes": set(),
    "rlsys.trainer": {"rlsys.algo", "rlsys.config", "rlsys.kernels", "rlsys.model",
                      "rlsys.candidate_rows", "rlsys.route_rows", "rlsys.trajectory"},
    "rlsys.engine": {"rlsys.config", "rlsys.kernels", "rlsys.model", "rlsys.tokenizer"},
    "rlsys.algo": {"rlsys.config", "rlsys.trajectory"},
    "rlsys.model": {"rlsys.config", "rlsys.kernels", "rlsys.tokenizer"},
    "rlsys.kernels": set(),
    "rlsys.ledger": {"rlsys.config", "rlsys.types"},
    "rlsys.tracking": {"rlsys.config"},
    "rlsys.config": set(),
    "rlsys.types": set(),
    "rlsys.tokenizer": set(),
    # a segment's per-token routes and candidate sets (torch-free: the rollout layer builds
    # segments)
    "rlsys.trajectory": {"rlsys.candidate_rows", "rlsys.route_rows"},
    "rlsys.route_rows": set(),
    "rlsys.candidate_rows": set(),
}  # fmt: skip

# Import name -> modules that must not be loaded by importing it (and all its modules).
FORBIDDEN_AT_IMPORT = {
    "rlsys.types": {"torch", "ray", "sqlalchemy", "redis"},
    "rlsys.config": {"torch", "ray", "sqlalchemy", "redis"},
    "rlsys.cli.main": {"torch", "ray", "sqlalchemy", "redis", "pydantic"},
    "rlsys.model": {"ray", "sqlalchemy", "redis", "docker", "vllm", "transformers"},
    "rlsys.kernels": {"ray", "sqlalchemy", "redis", "docker"},
    "rlsys.engine": {"ray", "sqlalchemy", "redis", "docker", "vllm", "transformers"},
    "rlsys.trainer": {"ray", "sqlalchemy", "redis", "docker", "vllm", "transformers"},
    "rlsys.algo": {"ray", "sqlalchemy", "redis", "docker"},
    "rlsys.ledger": {"torch", "ray", "docker"},
    "rlsys.sandboxes": {"torch", "ray", "sqlalchemy", "redis"},
    "rlsys.rollout": {"torch", "ray", "sqlalchemy", "redis", "docker"},
    "rlsys.control": {"torch", "ray", "docker", "vllm", "transformers"},
    "rlsys.tracking": {"torch", "ray", "sqlalchemy", "redis", "wandb", "mlflow"},
}


def _source_files():
    for folder in PACKAGES:
        yield from (ROOT / folder).rglob("*.py")


def _imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            roots.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


def test_third_party_modules_are_imported_only_by_their_owning_layer():
    offences = []
    for path in _source_files():
        rel = path.relative_to(ROOT).as_posix()
        for module in _imported_roots(path) & set(OWNERS):
            if not rel.startswith(OWNERS[module]):
                offences.append(f"{rel} imports {module}")
    assert offences == []


def test_code_imports_rlsys_subpackages_never_bare_folder_names():
    bare = {"ledger", "kernels", "actors", "control", "sandboxes"}
    offences = [
        f"{p.relative_to(ROOT)} imports {m}"
        for p in _source_files()
        for m in _imported_roots(p) & bare
    ]
    assert offences == []


def _package_of_file(path: Path) -> str:
    rel = path.relative_to(ROOT)
    if rel.parts[0] != "rlsys":
        return PACKAGES[rel.parts[0]]
    return "rlsys." + (rel.parts[1].removesuffix(".py") if len(rel.parts) > 1 else "")


def _own_imports(path: Path) -> set[str]:
    """Full names of the project modules `path` imports (`from rlsys import kernels` ->
    rlsys.kernels), relative imports excluded (they stay inside the package)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.startswith("rlsys."))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "rlsys":
                names.update(f"rlsys.{a.name}" for a in node.names)
            elif node.module.startswith("rlsys."):
                names.add(node.module)
    return names


def _edge_allowed(source: str, target: str) -> bool:
    if target == source or target.startswith(source + "."):
        return True
    return any(target == a or target.startswith(a + ".") for a in ALLOWED_EDGES[source])


def test_imports_between_own_packages_follow_the_edges_table():
    offences = []
    for path in _source_files():
        if path.name == "__init__.py" and path.parent == ROOT / "rlsys":
            continue
        source = _package_of_file(path)
        assert source in ALLOWED_EDGES, f"{source} ({path}) is missing from ALLOWED_EDGES"
        for target in sorted(_own_imports(path)):
            if not _edge_allowed(source, target):
                offences.append(f"{path.relative_to(ROOT)}: {source} -> {target}")
    assert offences == []


def test_the_edges_table_refuses_an_edge_outside_it():
    assert _edge_allowed("rlsys.rollout", "rlsys.engine.api")
    assert not _edge_allowed("rlsys.rollout", "rlsys.engine.engine")  # torch behind it
    assert not _edge_allowed("rlsys.sandboxes", "rlsys.rollout.scaffold")
    assert not _edge_allowed("rlsys.ledger", "rlsys.actors")
    assert not _edge_allowed("rlsys.control", "rlsys.actors")  # Ray behind it
    assert not _edge_allowed("rlsys.control", "rlsys.algo.objectives")  # torch behind it


def _modules_of(import_name: str) -> list[str]:
    folder = next(
        (f for f, n in PACKAGES.items() if import_name.startswith(n) and n != "rlsys"), None
    )
    if import_name.startswith("rlsys.cli") or import_name == "rlsys.types":
        return [import_name]
    if folder is None:
        folder = import_name.replace(".", "/")
        base, prefix = ROOT / folder, import_name
    else:
        base, prefix = ROOT / folder, PACKAGES[folder]
    if not base.is_dir():
        return [import_name]
    mods = []
    for path in sorted(base.rglob("*.py")):
        rel = path.relative_to(base).with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        if (
            "migrations" in parts
            or path.name == "__main__.py"
            or rel.as_posix().startswith("docker")
        ):
            continue
        mods.append(".".join([prefix, *parts]))
    return mods


@pytest.mark.parametrize("import_name", sorted(FORBIDDEN_AT_IMPORT))
def test_package_import_pulls_in_no_forbidden_module(import_name):
    modules = _modules_of(import_name)
    code = (
        "import importlib, json, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        f"print(json.dumps(sorted({sorted(FORBIDDEN_AT_IMPORT[import_name])!r} and "
        f"set({sorted(FORBIDDEN_AT_IMPORT[import_name])!r}) & set(sys.modules))))"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout.strip().splitlines()[-1]) == [], f"{import_name}: {modules}"
