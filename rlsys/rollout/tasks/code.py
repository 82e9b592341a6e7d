"""Code task: make a small Python function pass hidden unit tests, run in the sandbox.

The workspace starts with a stub `solution.py` and a visible, protected `test_solution.py`
(a few examples the agent may run). Tools: write_file, read_file, run. The episode ends on
`<answer>` (any text, e.g. "done") or a budget; then the hidden tests run in a fresh
sandbox (`code_verifier`).

Anti-hacking (see `rlsys.rollout.guard`): edits of the visible tests, hook files
(conftest.py, sitecustomize.py) and sources that short-circuit a verifier are refused in
flight or rolled back after the command, and penalised on that turn only; the rollout goes
on.

Invariants: an instance is a pure function of its index (problem = index mod bank size,
hidden cases seeded by the index); the episode's sandbox is closed by `close`.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from rlsys.rollout.guard import WorkspaceGuard
from rlsys.rollout.tasks.base import SandboxFactory, TaskInstance, Verdict
from rlsys.rollout.tasks.code_problems import PROBLEMS, PROBLEMS_BY_NAME, Problem
from rlsys.rollout.tasks.code_verifier import SOLUTION_FILE, RewardMode, verify_solution
from rlsys.rollout.toolcall import format_answer, format_tool_call
from rlsys.rollout.tools import CommandTimeoutPolicy, Tool, ToolContext, select_tools
from rlsys.sandboxes.base import Sandbox

TEST_FILE = "test_solution.py"


class CodeTaskConfig(BaseModel):
    """Hidden tests, reward rule and command limits of the code task."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["code"] = "code"
    hidden_cases: int = Field(8, ge=1, le=200, description="Hidden test cases per instance.")
    per_case_timeout_s: float = Field(2.0, gt=0, le=60, description="Time limit per case.")
    reward_mode: RewardMode = Field(
        "fraction", description="'fraction' of hidden cases passed, or 'pass_fail' (all or 0)."
    )
    command_timeout_s: float = Field(
        10.0, gt=0, le=600, description="Wall limit of one `run` tool command."
    )
    on_command_timeout: CommandTimeoutPolicy = Field(
        "fail",
        description="'fail': a command timeout ends the rollout as failed_timeout; "
        "'observe': the agent sees the timeout and goes on.",
    )


def visible_tests(problem: Problem) -> str:
    fn = problem.reference()
    cases = [(list(args), fn(*args)) for args in problem.examples]
    return (
        f"from solution import {problem.name}\n"
        f"CASES = {cases!r}\n"
        "for args, want in CASES:\n"
        f"    got = {problem.name}(*args)\n"
        "    assert got == want, f'got {got!r}, expected {want!r} for {args!r}'\n"
        "print('visible tests passed')\n"
    )


def stub(problem: Problem) -> str:
    return f"def {problem.name}(*args):\n    raise NotImplementedError\n"


class CodeEpisode:
    def __init__(self, instance: TaskInstance, config: CodeTaskConfig, sandbox: Sandbox,
                 open_sandbox: SandboxFactory) -> None:  # fmt: skip
        self.instance = instance
        self.config = config
        self.problem = PROBLEMS_BY_NAME[instance.data["problem"]]
        self.open_sandbox = open_sandbox
        self.sandbox = sandbox
        self.tools: Mapping[str, Tool] = select_tools(("write_file", "read_file", "run"))
        guard = WorkspaceGuard({TEST_FILE: visible_tests(self.problem).encode()})
        self.context = ToolContext(
            sandbox=sandbox,
            guard=guard,
            command_timeout_s=config.command_timeout_s,
            on_command_timeout=config.on_command_timeout,
        )
        guard.install(sandbox)
        sandbox.write_file(SOLUTION_FILE, stub(self.problem))
        guard.accept_write(SOLUTION_FILE, stub(self.problem).encode())

    def score(self, answer: str | None) -> Verdict:
        try:
            source = self.sandbox.read_file(SOLUTION_FILE)
        except OSError:
            return Verdict(0.0, {"passed": 0, "total": self.config.hidden_cases,
                                 "error": "no solution.py"})  # fmt: skip
        cases = self.problem.cases(self.instance.index, self.config.hidden_cases)
        return verify_solution(
            source,
            self.problem.name,
            cases,
            self.open_sandbox,
            per_case_s=self.config.per_case_timeout_s,
            reward_mode=self.config.reward_mode,
        )

    def close(self) -> None:
        self.sandbox.close()


def _write_run_answer(solution: str) -> list[str]:
    """The demonstrator's three turns: write the solution, run the visible tests, finish."""
    return [
        format_tool_call("write_file", solution, path=SOLUTION_FILE),
        format_tool_call("run", f"python3 {TEST_FILE}"),
        format_answer("done"),
    ]


class CodeTask:
    name = "code"

    def __init__(self, config: CodeTaskConfig | None = None) -> None:
        self.config = config or CodeTaskConfig()

    def instance(self, index: int) -> TaskInstance:
        problem = PROBLEMS[index % len(PROBLEMS)]
        prompt = (
            f"Write {SOLUTION_FILE} defining {problem.signature}: {problem.description}\n"
            f"{TEST_FILE} has examples (do not edit it). Tools: "
            '<tool name="write_file" path="...">content</tool>, '
            '<tool name="read_file" path="..."/>, <tool name="run">shell command</tool>. '
            "Hidden tests decide the reward. When done, reply <answer>done</answer>.\n"
        )
        return TaskInstance(self.name, index, prompt, {"problem": problem.name})

    def start(self, instance: TaskInstance, open_sandbox: SandboxFactory) -> CodeEpisode:
        sandbox = open_sandbox()
        try:
            return CodeEpisode(instance, self.config, sandbox, open_sandbox)
        except BaseException:
            sandbox.close()
            raise

    def oracle_turns(self, instance: TaskInstance) -> list[str]:
        return _write_run_answer(PROBLEMS_BY_NAME[instance.data["problem"]].solution)

    def slip_turns(self, instance: TaskInstance, rng: random.Random) -> list[str]:
        """The oracle's steps with a solution whose function returns None: it still
        writes, runs and answers, and fails the hidden tests."""
        problem = PROBLEMS_BY_NAME[instance.data["problem"]]
        return _write_run_answer(f"def {problem.signature}:\n    return None\n")

    @property
    def content_token_ids(self) -> frozenset[int]:
        return frozenset()
