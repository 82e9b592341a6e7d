"""The agent loop with a scripted engine: token flow, penalties, budgets, compaction, failures."""

import math

import pytest

from rlsys.config.sampling import SamplingConfig
from rlsys.engine.api import GenerationRequest, GenerationResult
from rlsys.rollout.compaction import CompactionConfig
from rlsys.rollout.events import ListEventSink
from rlsys.rollout.replay import ReplayGenerator
from rlsys.rollout.scaffold import ScaffoldConfig, run_rollout
from rlsys.rollout.tasks.arithmetic import ArithmeticTask
from rlsys.tokenizer import ByteTokenizer

pytestmark = pytest.mark.unit

TOK = ByteTokenizer()
TASK = ArithmeticTask()
INDEX = 7


def _no_sandbox():
    raise AssertionError("the arithmetic task must not open a sandbox")


def _run(generator, config=None, task=TASK, sink=None):
    sink = sink if sink is not None else ListEventSink()
    outcome = run_rollout(
        task,
        INDEX,
        generator,
        config=config or ScaffoldConfig(),
        sink=sink,
        open_sandbox=_no_sandbox,
        rollout_id="r1",
        group_id="g1",
    )
    return outcome, sink


def _calc() -> str:
    d = TASK.instance(INDEX).data
    return f'<tool name="calculator">{d["a"]}*{d["b"]}+{d["c"]}</tool>'


def _answer() -> str:
    return f"<answer>{TASK.instance(INDEX).data['result']}</answer>"


def _assert_consistent(segment):
    n = len(segment.token_ids)
    lists = [
        segment.policy_mask,
        segment.logprobs,
        segment.versions,
        segment.turn_index,
        segment.candidate_ids,
        segment.routed_experts,
    ]
    assert all(len(x) == n for x in lists)


class RichReplay(ReplayGenerator):
    """Adds per-token candidate sets and routed experts, as the real engine does."""

    def generate(self, request: GenerationRequest) -> GenerationResult:
        result = super().generate(request)
        n = len(result.token_ids)
        result.logprobs = [-0.5 - i for i in range(n)]
        result.candidate_ids = [[t, 0] for t in result.token_ids]
        result.routed_experts = [("experts", len(self.requests), i) for i in range(n)]
        return result


def test_token_ids_flow_unchanged_between_turns():
    # Raw ids, not text: 0xff is invalid UTF-8 and 257 is eos; a decode/re-encode would lose them.
    first = TOK.encode(_calc()) + [0xFF, TOK.eos_id]
    gen = RichReplay([first, _answer()])
    outcome, _ = _run(gen)
    assert outcome.failure is None and outcome.trajectory.reward == 1.0
    (seg,) = outcome.trajectory.segments
    _assert_consistent(seg)
    prompt = TOK.encode(TASK.instance(INDEX).prompt, bos=True)
    obs = seg.token_ids[len(prompt) + len(first) : len(gen.requests[1].prompt_ids)]
    assert TOK.decode(obs) == f"\n<obs>{TASK.instance(INDEX).data['result']}</obs>\n"
    assert seg.token_ids == prompt + gen.results[0].token_ids + obs + gen.results[1].token_ids
    assert gen.requests[0].prompt_ids == prompt
    assert gen.requests[1].prompt_ids == prompt + first + obs
    policy = [t for t, m in zip(seg.token_ids, seg.policy_mask, strict=True) if m]
    assert policy == gen.results[0].token_ids + gen.results[1].token_ids
    policy_lp = [lp for lp, m in zip(seg.logprobs, seg.policy_mask, strict=True) if m]
    assert policy_lp == gen.results[0].logprobs + gen.results[1].logprobs
    assert seg.candidate_ids[len(prompt)] == [first[0], 0]
    assert seg.routed_experts[len(prompt)] == ("experts", 1, 0)
    assert all(c is None for c, m in zip(seg.candidate_ids, seg.policy_mask, strict=True) if not m)
    assert set(seg.turn_index) == {-1, 0, 1}


def test_malformed_call_is_penalised_on_its_turn_only_and_the_rollout_continues():
    outcome, sink = _run(
        ReplayGenerator(["let me think", '<tool name="calc">1</tool>', _calc(), _answer()])
    )
    traj = outcome.trajectory
    assert outcome.failure is None and outcome.stop_reason == "answer"
    assert traj.reward == 1.0 and traj.num_turns == 4
    assert traj.turn_penalties == {0: -0.1, 1: -0.1}
    penalties = sink.of_kind("penalty")
    assert [(e.turn, e.data["kind"]) for e in penalties] == [(0, "malformed"), (1, "malformed")]
    assert penalties[0].data["reason"].startswith("no_action")
    assert penalties[1].data["reason"].startswith("bad_arguments: unknown tool 'calc'")
    assert penalties[0].tokens == len(TOK.encode("let me think"))
    text = TOK.decode(traj.segments[0].token_ids)
    assert "<obs>error: no_action" in text and "unknown tool 'calc'" in text
    assert [e.turn for e in sink.of_kind("turn")] == [0, 1, 2, 3]
    assert len(sink.of_kind("tool_call")) == 1
    assert traj.metadata["profile"]["penalties"] == 2


def test_turn_budget_ends_a_rollout_without_failing_it():
    outcome, sink = _run(ReplayGenerator([_calc()] * 5), ScaffoldConfig(max_turns=3))
    assert outcome.failure is None and outcome.stop_reason == "turn_budget"
    assert outcome.trajectory.reward == 0.0 and outcome.trajectory.num_turns == 3
    assert sink.of_kind("verdict")[0].data["reward"] == 0.0


def _compacting_policy(instruction: str):
    d = TASK.instance(INDEX).data

    def policy(request: GenerationRequest) -> str:
        text = TOK.decode(request.prompt_ids)
        if text.endswith(instruction):
            return f"<state>compute {d['a']}*{d['b']}+{d['c']}</state>"
        if "<resume>" in text and "<obs>" in text:
            return _answer()
        return _calc()

    return policy


def test_compaction_starts_a_new_segment_from_the_policys_state():
    compaction = CompactionConfig(max_compactions=1, max_state_tokens=24)
    config = ScaffoldConfig(
        context_budget=520,
        sampling=SamplingConfig(max_tokens_per_turn=48),
        max_observation_tokens=16,
        max_turns=20,
        compaction=compaction,
    )
    gen = ReplayGenerator([_compacting_policy(compaction.instruction)] * 20)
    outcome, sink = _run(gen, config)
    traj = outcome.trajectory
    assert outcome.failure is None and traj.reward == 1.0
    assert len(traj.segments) == 2 and outcome.profile.compactions == 1
    (event,) = sink.of_kind("compaction")
    old, new = traj.segments
    for seg in traj.segments:
        _assert_consistent(seg)
        assert len(seg.token_ids) <= config.context_budget
    # The compaction turn is a policy turn of the old segment (trained under the same reward).
    comp_turn = event.turn
    comp_ids = [
        t
        for t, i, m in zip(old.token_ids, old.turn_index, old.policy_mask, strict=True)
        if i == comp_turn and m
    ]
    assert comp_ids == gen.results[comp_turn].token_ids
    assert TOK.decode(comp_ids).startswith("<state>")
    # The new context is the task prompt + the state ids exactly as the engine produced them.
    prompt = TOK.encode(TASK.instance(INDEX).prompt, bos=True)
    state = TOK.encode(f"compute {TASK.instance(INDEX).data['a']}")
    assert new.token_ids[: len(prompt)] == prompt
    assert (
        state[:10] == new.token_ids[len(prompt) + len(TOK.encode(compaction.resume_header)) :][:10]
    )
    assert (
        gen.requests[comp_turn + 1].prompt_ids
        == new.token_ids[: len(gen.requests[comp_turn + 1].prompt_ids)]
    )
    assert set(new.turn_index) >= {-1, comp_turn + 1}
    assert not any(m for m, i in zip(new.policy_mask, new.turn_index, strict=True) if i == -1)
    assert event.tokens == len(
        TOK.encode(
            f"compute {TASK.instance(INDEX).data['a']}*"
            f"{TASK.instance(INDEX).data['b']}+{TASK.instance(INDEX).data['c']}"
        )
    )
    assert all(
        len(r.prompt_ids) + r.sampling.max_tokens_per_turn <= config.context_budget
        for r in gen.requests
    )


def test_full_context_without_compactions_left_stops_at_the_context_budget():
    config = ScaffoldConfig(
        context_budget=400,
        sampling=SamplingConfig(max_tokens_per_turn=48),
        max_observation_tokens=16,
        max_turns=50,
        compaction=CompactionConfig(max_compactions=0),
    )
    outcome, sink = _run(ReplayGenerator([_calc()] * 50), config)
    assert outcome.failure is None and outcome.stop_reason == "context_budget"
    assert len(outcome.trajectory.segments) == 1 and not sink.of_kind("compaction")
    assert len(outcome.trajectory.segments[0].token_ids) <= 400


def test_engine_exception_ends_the_rollout_as_failed_engine():
    outcome, sink = _run(ReplayGenerator([_calc(), ConnectionError("replica 3 died")]))
    assert outcome.state == "failed_engine" and outcome.stop_reason is None
    assert "replica 3 died" in outcome.failure.reason and outcome.failure.turn == 1
    assert math.isnan(outcome.trajectory.reward)  # never a reward of 0
    assert sink.events[-1].kind == "failure" and sink.events[-1].data["state"] == "failed_engine"
    assert not sink.of_kind("verdict")


class ErrorEngine:
    def __init__(self, result: GenerationResult) -> None:
        self.result = result

    def generate(self, request: GenerationRequest) -> GenerationResult:
        return self.result


@pytest.mark.parametrize(
    ("result", "needle"),
    [
        (
            GenerationResult("x", finish_reason="error", error="CUDA out of memory"),
            "CUDA out of memory",
        ),
        (GenerationResult("x", finish_reason="abort"), "abort"),
        (GenerationResult("x", token_ids=[1, 2], logprobs=[0.0], versions=[0, 0]), "logprobs"),
        (
            GenerationResult("x", token_ids=[1, 9999], logprobs=[0.0] * 2, versions=[0] * 2),
            "malformed",
        ),
    ],
)
def test_engine_error_results_end_the_rollout_as_failed_engine(result, needle):
    outcome, _ = _run(ErrorEngine(result))
    assert outcome.state == "failed_engine" and needle in outcome.failure.reason


class BrokenVerifierTask(ArithmeticTask):
    def start(self, instance, open_sandbox):
        episode = super().start(instance, open_sandbox)
        episode.score = lambda answer: 1 / 0
        return episode


def test_verifier_crash_is_failed_reward_not_zero():
    outcome, _ = _run(ReplayGenerator([_answer()]), task=BrokenVerifierTask())
    assert outcome.state == "failed_reward" and "ZeroDivisionError" in outcome.failure.reason
    assert math.isnan(outcome.trajectory.reward)


def test_a_prompt_that_cannot_fit_one_turn_is_a_config_error():
    with pytest.raises(ValueError, match="context_budget"):
        _run(
            ReplayGenerator([_answer()]),
            ScaffoldConfig(context_budget=200, sampling=SamplingConfig(max_tokens_per_turn=128)),
        )


def test_tool_latency_delays_each_observation_deterministically_and_is_capped():
    import time

    from rlsys.rollout.latency import ToolLatencyConfig, tool_delay_s

    cfg = ToolLatencyConfig(median_s=0.5, sigma=1.5, max_s=4.0)
    draws = [tool_delay_s(cfg, f"r{i}", 0) for i in range(2000)]
    assert draws == [tool_delay_s(cfg, f"r{i}", 0) for i in range(2000)]
    assert max(draws) <= 4.0 and min(draws) > 0
    median = sorted(draws)[1000]
    assert 0.4 < median < 0.6 and sum(d > 5 * median for d in draws) > 20  # a long tail
    fixed = ScaffoldConfig(tool_latency=ToolLatencyConfig(median_s=0.15, sigma=0.0))
    started = time.monotonic()
    outcome, _ = _run(ReplayGenerator(["<tool>broken", _calc(), _answer()]), fixed)
    assert outcome.trajectory.reward == 1.0  # the environment is late, never different
    assert time.monotonic() - started >= 2 * 0.15  # two observations, each delayed
