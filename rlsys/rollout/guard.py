"""Anti-reward-hacking guard for a task workspace: protected files and forbidden edits.

What it stops, and when:
- Before a tool runs ("in flight"): a write to a protected file (tests, verifier helpers)
  or to a file that would hook the test run (conftest.py, sitecustomize.py, ...); Python
  source that short-circuits a verifier (sys.exit/os._exit at import, patching unittest or
  builtins, frame inspection); a shell command that edits a protected or hook file.
- After every shell command (`audit`): protected files are re-hashed and restored when
  changed, hook files are removed, and Python sources written earlier are re-checked and
  rolled back to their last accepted content — the static command check is only a first
  line; the audit is what holds.

Each refusal or rollback is a turn-level penalty (the scaffold records it); the rollout
goes on. Read-only permissions cannot protect anything here (the sandbox user owns the
workspace folder and may rename what it cannot write), so hashes are the mechanism.
The verifier does not rely on this guard alone: it runs in a fresh sandbox, takes only the
solution file and trusts no exit code (see `rlsys.rollout.tasks.code_verifier`).
"""

from __future__ import annotations

import hashlib
import posixpath
import re
from collections.abc import Mapping

from rlsys.sandboxes.base import WORKSPACE_MOUNT, Sandbox, SandboxError

HOOK_FILES = frozenset({"conftest.py", "sitecustomize.py", "usercustomize.py", "pytest.ini"})

# Python that ends or rewires a test run instead of computing an answer. Why each is here:
# exits make a runner stop early; unittest/pytest/builtins patching fakes results; frame
# and gc inspection reach into the runner's locals.
SOURCE_RULES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(p), why)
    for p, why in (
        (r"\bsys\s*\.\s*exit\b|\braise\s+SystemExit\b|(?<![\w.])(exit|quit)\s*\(", "exits"),
        (r"\bos\s*\.\s*(_exit|kill|abort)\b", "kills the process"),
        (r"\b(import|from)\s+(unittest|pytest|doctest|builtins|atexit|inspect|gc|ctypes)\b",
         "imports a test or interpreter internals module"),
        (r"__builtins__|__import__|\bsys\s*\.\s*(modules|_getframe|settrace|setprofile)\b",
         "rewires the interpreter"),
    )
)  # fmt: skip

_EDIT_VERBS = r"\b(rm|mv|sed|chmod|chown|tee|truncate|ln|dd|touch|unlink|install|perl)\b"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def normalize(path: str) -> str:
    """Workspace-relative normal form of a path as the agent wrote it."""
    norm = posixpath.normpath(path)
    if norm == WORKSPACE_MOUNT or norm.startswith(WORKSPACE_MOUNT + "/"):
        norm = norm[len(WORKSPACE_MOUNT) :].lstrip("/") or "."
    return norm


class WorkspaceGuard:
    """Owns the protected files of one workspace and judges every edit of it."""

    def __init__(self, protected: Mapping[str, bytes]) -> None:
        self.protected = {normalize(p): bytes(d) for p, d in protected.items()}
        self.hashes = {p: sha256(d) for p, d in self.protected.items()}
        self.accepted_sources: dict[str, bytes] = {}

    def install(self, sandbox: Sandbox) -> None:
        for path, data in self.protected.items():
            sandbox.write_file(path, data)

    def check_write(self, path: str, data: str) -> str | None:
        """Why a write of `data` to `path` is refused, or None when it is fine."""
        norm = normalize(path)
        if norm in self.protected:
            return f"{path} is protected"
        if posixpath.basename(norm) in HOOK_FILES:
            return f"{path} would hook the test run"
        if norm.endswith(".py"):
            return check_source(data)
        return None

    def accept_write(self, path: str, data: bytes) -> None:
        norm = normalize(path)
        if norm.endswith(".py"):
            self.accepted_sources[norm] = data

    def check_command(self, command: str) -> str | None:
        """Why a shell command is refused before it runs: it edits a guarded file."""
        for name in [*self.protected, *HOOK_FILES]:
            base = re.escape(posixpath.basename(name))
            redirect = rf">\s*['\"]?[\w./-]*{base}"
            verb = rf"{_EDIT_VERBS}[^;&|\n]*{base}"
            write = rf"open\([^)]*{base}[^)]*['\"][wa+]"
            if re.search(f"{redirect}|{verb}|{write}", command):
                return f"the command edits {name}"
        return None

    def audit(self, sandbox: Sandbox) -> list[str]:
        """After a command: restore protected files, drop hooks, roll back bad sources."""
        problems: list[str] = []
        for path, data in self.protected.items():
            if _read(sandbox, path) != data:
                _replace(sandbox, path, data)
                problems.append(f"{path} was modified (restored)")
        for name in HOOK_FILES:
            if _read(sandbox, name) is not None:
                sandbox.run(["rm", "-rf", "--", name])
                problems.append(f"{name} was created (removed)")
        for path, accepted in self.accepted_sources.items():
            current = _read(sandbox, path)
            if current is None or current == accepted:
                continue
            why = check_source(current.decode("utf-8", errors="replace"))
            if why is not None:
                _replace(sandbox, path, accepted)
                problems.append(f"{path}: {why} (rolled back)")
            else:
                self.accepted_sources[path] = current
        return problems


def check_source(source: str) -> str | None:
    """Why Python `source` is refused as a verifier short-circuit, or None."""
    for pattern, why in SOURCE_RULES:
        found = pattern.search(source)
        if found is not None:
            return f"the source {why} ({found.group(0)!r})"
    return None


def _read(sandbox: Sandbox, path: str) -> bytes | None:
    """Contents of a regular file, None when absent or not a plain file (e.g. a symlink)."""
    try:
        return sandbox.read_file(path)
    except (OSError, SandboxError):
        return None


def _replace(sandbox: Sandbox, path: str, data: bytes) -> None:
    # rm first: the agent may have swapped the file for a symlink or a folder.
    sandbox.run(["rm", "-rf", "--", path])
    sandbox.write_file(path, data)
