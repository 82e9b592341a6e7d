"""The tools an agent can call, and the registry that maps a tool name to its code.

Tools that execute code (`run`) or touch files run in the rollout's sandbox; the
calculator evaluates arithmetic with an AST walker in-process (no code is executed).

Invariants:
- A tool never raises for what the agent did wrong at run time (a failing command, a bad
  expression): that is an observation. It raises `ToolArgumentError` for a call that does
  not fit the tool's schema (the scaffold turns it into a malformed-call penalty) and
  `RolloutAbort` for infrastructure failures (sandbox broken, command timeout when
  configured to fail).
- A refused hack attempt returns an outcome with `blocked` set and changes nothing in the
  workspace (or has been rolled back by the guard's audit).
"""

from __future__ import annotations

import ast
import difflib
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from rlsys.rollout.failures import RolloutAbort, describe
from rlsys.rollout.guard import WorkspaceGuard, normalize
from rlsys.rollout.toolcall import ToolCall
from rlsys.sandboxes.base import Sandbox, SandboxError

CommandTimeoutPolicy = Literal["fail", "observe"]


class ToolArgumentError(ValueError):
    """The call does not fit the tool (unknown tool, missing attribute, empty body)."""


@dataclass
class DepthTracker:
    """How deep a rollout went into its workspace: files touched, lines edited."""

    files_touched: set[str] = field(default_factory=set)
    lines_edited: int = 0


@dataclass
class ToolContext:
    sandbox: Sandbox | None
    guard: WorkspaceGuard | None = None
    depth: DepthTracker = field(default_factory=DepthTracker)
    command_timeout_s: float = 10.0
    on_command_timeout: CommandTimeoutPolicy = "fail"
    max_read_bytes: int = 16384

    def require_sandbox(self) -> Sandbox:
        assert self.sandbox is not None, "a sandbox tool was exposed without a sandbox"
        return self.sandbox


@dataclass(frozen=True)
class ToolOutcome:
    observation: str
    blocked: str | None = None  # a refused or rolled-back hack attempt: penalise this turn
    data: dict[str, Any] = field(default_factory=dict)  # JSON-ready facts for the event


class Tool(Protocol):
    name: str

    def run(self, call: ToolCall, ctx: ToolContext) -> ToolOutcome: ...


def execute(call: ToolCall, tools: Mapping[str, Tool], ctx: ToolContext) -> ToolOutcome:
    """Run `call` with the tool it names; a broken sandbox ends the rollout."""
    tool = tools.get(call.name)
    if tool is None:
        raise ToolArgumentError(f"unknown tool {call.name!r}; available: {', '.join(tools)}")
    try:
        return tool.run(call, ctx)
    except SandboxError as err:
        raise RolloutAbort("failed_sandbox", describe(err)) from err


def _attr(call: ToolCall, key: str) -> str:
    value = call.attrs.get(key, "").strip()
    if not value:
        raise ToolArgumentError(f'{call.name} needs a {key}="..." attribute')
    return value


_BINOPS: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
MAX_EXPONENT = 64
MAX_MAGNITUDE = 10**30


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        # Why the caps: 9**9**9 would keep the host busy for minutes.
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent above {MAX_EXPONENT}")
        value = _BINOPS[type(node.op)](left, right)
        if abs(value) > MAX_MAGNITUDE:
            raise ValueError("result too large")
        return value
    raise ValueError(f"unsupported syntax: {type(node).__name__}")


class Calculator:
    """Integer and float arithmetic: + - * / // % ** and parentheses."""

    name = "calculator"

    def run(self, call: ToolCall, ctx: ToolContext) -> ToolOutcome:
        expr = call.body.strip()
        if not expr:
            raise ToolArgumentError("calculator needs an expression in its body")
        try:
            value = _evaluate(ast.parse(expr, mode="eval").body)
        except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as err:
            return ToolOutcome(f"error: {err}", data={"ok": False})
        text = str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)
        return ToolOutcome(text, data={"ok": True})


class WriteFile:
    """Write the body to the file named by `path` (created or replaced)."""

    name = "write_file"

    def run(self, call: ToolCall, ctx: ToolContext) -> ToolOutcome:
        path = _attr(call, "path")
        sandbox = ctx.require_sandbox()
        if (error := _path_error(path)) is not None:
            return ToolOutcome(error, data={"path": path, "ok": False})
        if ctx.guard is not None and (why := ctx.guard.check_write(path, call.body)) is not None:
            return ToolOutcome(f"refused: {why}", blocked=why, data={"path": path})
        old = _read_text(sandbox, path)
        sandbox.write_file(path, call.body)
        if ctx.guard is not None:
            ctx.guard.accept_write(path, call.body.encode())
        edited = _lines_changed(old or "", call.body)
        ctx.depth.files_touched.add(normalize(path))
        ctx.depth.lines_edited += edited
        return ToolOutcome(f"wrote {path} ({edited} lines changed)", data={"path": path})


class ReadFile:
    """Read the file named by `path` (truncated to the configured size)."""

    name = "read_file"

    def run(self, call: ToolCall, ctx: ToolContext) -> ToolOutcome:
        path = _attr(call, "path")
        text = _read_text(ctx.require_sandbox(), path, ctx.max_read_bytes)
        if text is None:
            return ToolOutcome(f"error: cannot read {path}", data={"path": path, "ok": False})
        return ToolOutcome(text, data={"path": path, "ok": True})


class RunCommand:
    """Run the body as a shell command in the workspace; shows exit code and output."""

    name = "run"

    def run(self, call: ToolCall, ctx: ToolContext) -> ToolOutcome:
        command = call.body.strip()
        if not command:
            raise ToolArgumentError("run needs a shell command in its body")
        sandbox = ctx.require_sandbox()
        if ctx.guard is not None and (why := ctx.guard.check_command(command)) is not None:
            return ToolOutcome(f"refused: {why}", blocked=why)
        result = sandbox.run(command, timeout_s=ctx.command_timeout_s)
        if result.killed_reason == "timeout" and ctx.on_command_timeout == "fail":
            raise RolloutAbort(
                "failed_timeout",
                f"command timed out after {ctx.command_timeout_s}s; stderr: {result.stderr_text}",
            )
        problems = ctx.guard.audit(sandbox) if ctx.guard is not None else []
        data = {
            "exit_code": result.exit_code,
            "killed_reason": result.killed_reason,
            "wall_s": round(result.wall_s, 4),
            "stdout_bytes": len(result.stdout),
            "stderr_bytes": len(result.stderr),
        }
        killed = f" (killed: {result.killed_reason})" if result.killed_reason else ""
        observation = f"exit={result.exit_code}{killed}\n{result.stdout_text}{result.stderr_text}"
        if problems:
            why = "; ".join(problems)
            return ToolOutcome(f"{observation}\nrefused: {why}", blocked=why, data=data)
        return ToolOutcome(observation, data=data)


def _path_error(path: str) -> str | None:
    norm = normalize(path)
    if norm.startswith("/") or norm in (".", "..") or norm.startswith("../"):
        return f"error: {path} is not a file path inside the workspace"
    return None


def _read_text(sandbox: Sandbox, path: str, max_bytes: int | None = None) -> str | None:
    try:
        return sandbox.read_file(path, max_bytes).decode("utf-8", errors="replace")
    except OSError:
        return None
    except SandboxError as err:
        # The agent's bad path (outside, a folder), not a broken sandbox; see workspace.py.
        if "outside the workspace" in str(err) or "not a" in str(err):
            return None
        raise


def _lines_changed(old: str, new: str) -> int:
    diff = difflib.ndiff(old.splitlines(), new.splitlines())
    return sum(1 for line in diff if line[:2] in ("+ ", "- "))


TOOLS: dict[str, Tool] = {t.name: t for t in (Calculator(), WriteFile(), ReadFile(), RunCommand())}


def select_tools(names: tuple[str, ...]) -> dict[str, Tool]:
    """The registry entries a task exposes, in its order."""
    return {name: TOOLS[name] for name in names}
