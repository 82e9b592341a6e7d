"""Both tasks end to end through the real scaffold; the code task in real bwrap sandboxes."""

import math
import random
import shutil
import tempfile
import uuid
from pathlib import Path

import pytest

from rlsys.config.sampling import SamplingConfig
from rlsys.rollout.demos import make_demonstrations
from rlsys.rollout.events import ListEventSink
from rlsys.rollout.replay import ReplayGenerator
from rlsys.rollout.scaffold import ScaffoldConfig, run_rollout
from rlsys.rollout.tasks.base import TaskInstance
from rlsys.rollout.tasks.code import TEST_FILE, CodeTask, CodeTaskConfig, visible_tests
from rlsys.rollout.tasks.code_problems import PROBLEMS_BY_NAME
from rlsys.rollout.tasks.code_verifier import verify_solution
from rlsys.rollout.tasks.registry import build_task, parse_task_config
from rlsys.rollout.toolcall import format_tool_call
from rlsys.tokenizer import ByteTokenizer
from tests.scaffold.helpers import CountingBwrap

pytestmark = pytest.mark.unit

TOK = ByteTokenizer()
CODE_INDEX = 0  # digit_sum
PROBLEM = PROBLEMS_BY_NAME["digit_sum"]


@pytest.fixture
def bwrap():
    # Not under tmp_path: pytest makes that 0700, and bwrap runs as an unprivileged uid.
    root = Path(tempfile.gettempdir()) / f"rlsys-scaffold-test-{uuid.uuid4().hex[:8]}"
    factory = CountingBwrap(root)
    try:
        yield factory
        assert factory.leftovers() == []  # every sandbox, the verifier's too, was torn down
    finally:
        for sandbox in factory.opened:
            sandbox.close()
        shutil.rmtree(root, ignore_errors=True)


def _rollout(task, index, script, bwrap_or_factory, config=None):
    sink = ListEventSink()
    outcome = run_rollout(
        task,
        index,
        ReplayGenerator(script),
        config=config or ScaffoldConfig(),
        sink=sink,
        open_sandbox=bwrap_or_factory,
        rollout_id="r",
        group_id="g",
    )
    return outcome, sink


def test_arithmetic_oracle_scores_one_and_a_wrong_answer_zero(bwrap):
    task = build_task("arithmetic")
    good, _ = _rollout(task, 3, task.oracle_turns(task.instance(3)), bwrap)
    bad, _ = _rollout(
        task, 3, [task.oracle_turns(task.instance(3))[0], "<answer>12</answer>"], bwrap
    )
    assert (good.trajectory.reward, bad.trajectory.reward) == (1.0, 0.0)
    assert bwrap.opened == []  # the calculator runs no code


def test_arithmetic_random_policy_scores_about_zero():
    rng = random.Random(0)
    task = build_task("arithmetic")
    rewards = []
    for index in range(100):
        script = [[rng.randrange(256) for _ in range(rng.randint(1, 40))] for _ in range(8)]
        outcome, _ = _rollout(task, index, script, lambda: None)
        rewards.append(outcome.trajectory.reward)
    assert sum(rewards) == 0.0


def test_demonstrations_are_deterministic_in_the_seed(bwrap):
    task = build_task("arithmetic")
    first = make_demonstrations(task, 11, 4, bwrap)
    again = make_demonstrations(task, 11, 4, bwrap)
    other = make_demonstrations(task, 12, 4, bwrap)
    ids = [[s.token_ids for s in d.segments] for d in first]
    assert ids == [[s.token_ids for s in d.segments] for d in again]
    assert ids != [[s.token_ids for s in d.segments] for d in other]
    assert all(d.reward == 1.0 and d.num_policy_tokens > 0 for d in first)


def test_a_demonstration_turn_over_the_turn_budget_is_a_config_error(bwrap):
    # the code task's longest reference solution is 274 tokens: a 160-token budget would cut
    # it and derail the demonstration far from the cause; the error names the setting
    task = build_task(parse_task_config({"type": "code", "hidden_cases": 2}))
    with pytest.raises(ValueError, match="sampling.max_tokens_per_turn"):
        config = ScaffoldConfig(sampling=SamplingConfig(max_tokens_per_turn=160))
        make_demonstrations(task, 0, 6, bwrap, config)


def test_slipping_demonstrator_mixes_in_mistakes_at_its_rate(bwrap):
    task = build_task(parse_task_config({"type": "arithmetic", "instructions": False}))
    demos = make_demonstrations(task, 11, 200, bwrap, slip_rate=0.3)
    again = make_demonstrations(task, 11, 200, bwrap, slip_rate=0.3)
    assert [d.reward for d in demos] == [d.reward for d in again]
    slips = [d for d in demos if d.reward == 0.0]
    assert 0.2 < len(slips) / len(demos) < 0.4  # binomial(200, 0.3): ~4.8 sd either side
    # A slip is two well-formed turns: a wrong expression, its output copied faithfully.
    for d in slips:
        text = TOK.decode(d.segments[0].token_ids)
        assert text.count("<tool name=") == 1 and text.count("<answer>") == 1
        observed = text.split("<obs>")[1].split("</obs>")[0]
        answered = text.split("<answer>")[1].split("</answer>")[0]
        assert answered == observed and d.num_policy_tokens > 0 and d.turn_penalties == {}
    clean = make_demonstrations(task, 11, 200, bwrap)
    assert all(d.reward == 1.0 for d in clean)


def test_arithmetic_slip_is_wrong_even_when_the_addend_is_zero():
    task = build_task("arithmetic")
    rng = random.Random(0)
    for a, b, c in ((3, 4, 5), (3, 4, 0), (2, 2, 0)):
        instance = TaskInstance("arithmetic", 0, "", {"a": a, "b": b, "c": c, "result": a * b + c})
        turns = task.slip_turns(instance, rng)
        answer = turns[-1].split("<answer>")[1].split("</answer>")[0]
        assert int(answer) != a * b + c, (a, b, c, turns)


def test_slip_rate_out_of_range_is_refused():
    with pytest.raises(ValueError, match="slip_rate"):
        make_demonstrations(build_task("arithmetic"), 0, 4, lambda: None, slip_rate=1.0)


def test_code_task_slip_runs_and_scores_zero(bwrap):
    task = CodeTask()
    turns = task.slip_turns(task.instance(CODE_INDEX), random.Random(0))
    outcome, _ = _rollout(task, CODE_INDEX, turns, bwrap)
    assert outcome.failure is None and outcome.trajectory.reward == 0.0


def test_code_task_correct_solution_scores_one(bwrap):
    task = CodeTask()
    outcome, sink = _rollout(task, CODE_INDEX, task.oracle_turns(task.instance(CODE_INDEX)), bwrap)
    assert outcome.failure is None and outcome.trajectory.reward == 1.0
    assert outcome.verdict.details["passed"] == outcome.verdict.details["total"] == 8
    assert "visible tests passed" in TOK.decode(outcome.trajectory.segments[0].token_ids)
    assert outcome.profile.files_touched == ["solution.py"] and outcome.profile.lines_edited > 0
    assert outcome.trajectory.metadata["profile"]["tool_calls"] == 2
    assert len(bwrap.opened) == 2  # the episode's sandbox and a fresh one for the verifier


def test_code_task_wrong_solution_scores_zero(bwrap):
    wrong = "def digit_sum(n):\n    return -1\n"
    script = [format_tool_call("write_file", wrong, path="solution.py"), "<answer>done</answer>"]
    outcome, _ = _rollout(CodeTask(), CODE_INDEX, script, bwrap)
    assert outcome.failure is None and outcome.trajectory.reward == 0.0


def test_hacking_attempts_are_refused_penalised_per_turn_and_the_rollout_continues(bwrap):
    hacks = [
        format_tool_call("write_file", "print('passed')\n", path=TEST_FILE),  # edit the tests
        format_tool_call("write_file", "import pytest\n", path="conftest.py"),  # hook the run
        format_tool_call("write_file", "import sys\nsys.exit(0)\n", path="solution.py"),
        format_tool_call("write_file", "import unittest\n", path="sub/../solution.py"),
        format_tool_call("run", f"echo 'print(1)' > {TEST_FILE}"),  # refused before running
        format_tool_call("run", f"cp /dev/null {TEST_FILE}"),  # passes the static check: audit
        format_tool_call("run", "printf 'import os\\nos._exit(0)\\n' > solution.py"),  # audit
        format_tool_call("run", "echo x > sitecustomize.py"),
    ]
    honest = CodeTask().oracle_turns(CodeTask().instance(CODE_INDEX))
    outcome, sink = _rollout(
        CodeTask(), CODE_INDEX, [*hacks, *honest], bwrap, ScaffoldConfig(max_turns=12)
    )
    traj = outcome.trajectory
    assert outcome.failure is None and outcome.stop_reason == "answer"
    assert traj.turn_penalties == {t: -0.5 for t in range(len(hacks))}  # the hack turns only
    assert [e.data["kind"] for e in sink.of_kind("penalty")] == ["blocked_hack"] * len(hacks)
    assert traj.reward == 1.0  # the honest solution still scores; tests ran intact
    text = TOK.decode(traj.segments[0].token_ids)
    assert text.count("refused:") == len(hacks)
    assert "was modified (restored)" in text and "(rolled back)" in text
    assert "visible tests passed" in text


def test_edits_through_commands_are_rolled_back_in_the_workspace(bwrap):
    captured = {}

    def look(request):
        sandbox = bwrap.opened[0]
        captured["tests"] = sandbox.read_file(TEST_FILE).decode()
        captured["solution"] = sandbox.read_file("solution.py").decode()
        return "<answer>done</answer>"

    script = [
        format_tool_call("run", f"rm -f x; mv {TEST_FILE} t.py || true"),
        format_tool_call("run", f"cat /dev/null | dd of={TEST_FILE}; true"),
        format_tool_call(
            "run", f"ln -sf /etc/passwd {TEST_FILE}; echo 'import sys; sys.exit(0)' >> solution.py"
        ),
        look,
    ]
    outcome, sink = _rollout(CodeTask(), CODE_INDEX, script, bwrap)
    assert captured["tests"] == visible_tests(PROBLEM)
    assert "sys.exit" not in captured["solution"]
    assert sorted(outcome.trajectory.turn_penalties) == [0, 1, 2]


@pytest.mark.parametrize(
    "source",
    [
        "import os\nos._exit(0)\n",
        "import sys\nsys.exit(0)\n",
        "raise SystemExit(0)\n",
        "class A:\n    def __eq__(self, o):\n        return True\n\ndef digit_sum(n):\n    return A()\n",
        "print('0 0 pass')\ndef digit_sum(n):\n    return None\n",
        "def digit_sum(n):\n    while True:\n        pass\n",
    ],
)
def test_verifier_cannot_be_short_circuited(bwrap, source):
    cases = PROBLEM.cases(0, 3)
    verdict = verify_solution(source.encode(), "digit_sum", cases, bwrap, per_case_s=0.5)
    assert verdict.reward == 0.0 and verdict.details["passed"] == 0


def test_verifier_counts_partial_passes_and_pass_fail_mode(bwrap):
    source = b"def digit_sum(n):\n    return sum(map(int, str(n))) if n % 2 else -1\n"
    cases = [([1], 1), ([2], 2), ([11], 2), ([12], 3)]
    fraction = verify_solution(source, "digit_sum", cases, bwrap, per_case_s=1.0)
    strict = verify_solution(source, "digit_sum", cases, bwrap, reward_mode="pass_fail")
    assert (fraction.reward, strict.reward) == (0.5, 0.0)


def test_command_timeout_ends_the_rollout_as_failed_timeout(bwrap):
    task = CodeTask(CodeTaskConfig(command_timeout_s=1.0))
    outcome, sink = _rollout(
        task, CODE_INDEX, [format_tool_call("run", "echo busy >&2; sleep 30")], bwrap
    )
    assert outcome.state == "failed_timeout" and outcome.failure.turn == 0
    assert "timed out" in outcome.failure.reason and "busy" in outcome.failure.reason
    assert math.isnan(outcome.trajectory.reward)
    assert sink.events[-1].kind == "failure"


def test_command_timeout_can_be_an_observation(bwrap):
    task = CodeTask(CodeTaskConfig(command_timeout_s=1.0, on_command_timeout="observe"))
    script = [format_tool_call("run", "sleep 30"), "<answer>done</answer>"]
    outcome, _ = _rollout(task, CODE_INDEX, script, bwrap)
    assert outcome.failure is None and outcome.trajectory.reward == 0.0
    assert "(killed: timeout)" in TOK.decode(outcome.trajectory.segments[0].token_ids)


def test_broken_sandbox_ends_the_rollout_as_failed_sandbox(bwrap):
    def crash(request):
        bwrap.opened[0].close()  # the sandbox goes away under the rollout
        return format_tool_call("run", "true")

    outcome, _ = _rollout(CodeTask(), CODE_INDEX, [crash], bwrap)
    assert outcome.state == "failed_sandbox" and "closed" in outcome.failure.reason


def test_paths_outside_the_workspace_are_observations_not_failures(bwrap):
    script = [
        format_tool_call("write_file", "x", path="../escape.py"),
        format_tool_call("read_file", path="/etc/passwd"),
        "<answer>done</answer>",
    ]
    outcome, sink = _rollout(CodeTask(), CODE_INDEX, script, bwrap)
    assert outcome.failure is None and outcome.trajectory.turn_penalties == {}
    text = TOK.decode(outcome.trajectory.segments[0].token_ids)
    assert "is not a file path inside the workspace" in text and "cannot read /etc/passwd" in text


def test_arithmetic_names_its_answer_digits_and_the_prompt_can_drop_instructions():
    from rlsys.rollout.tasks.arithmetic import DIGIT_IDS, ArithmeticTask, ArithmeticTaskConfig
    from rlsys.rollout.tasks.code import CodeTask

    assert ArithmeticTask().content_token_ids == DIGIT_IDS == frozenset(range(48, 58))
    assert CodeTask().content_token_ids == frozenset()
    full = ArithmeticTask().instance(5)
    terse = ArithmeticTask(ArithmeticTaskConfig(instructions=False)).instance(5)
    d = full.data
    assert terse.prompt == f"Compute {d['a']}*{d['b']}+{d['c']}.\n"
    assert full.prompt.endswith(terse.prompt) and "calculator" in full.prompt
