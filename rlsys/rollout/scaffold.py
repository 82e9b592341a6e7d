"""The agent loop: generate -> parse the action -> run the tool -> append the observation.

One call of `run_rollout` drives one rollout of one task instance against a `Generator`
and returns a `RolloutOutcome`: a scored trajectory, or a typed failure.

Invariants:
- Token ids flow end to end: each request's `prompt_ids` is the current segment's ids; the
  engine's ids are appended unchanged and observation ids are appended after them; the
  context is never decoded and re-encoded.
- Every segment keeps all per-token lists as long as `token_ids` (see `rlsys.trajectory`);
  policy tokens are exactly the engine-sampled ones.
- A malformed action or a blocked hack attempt is a penalty on that turn only
  (`turn_penalties[turn]`), an event, and an observation that says what was wrong; the
  rollout continues.
- Engine error, broken sandbox, timeout and verifier crash end the rollout with a
  `RolloutFailure` whose state names it; its trajectory's reward is NaN, never 0, so it
  cannot be trained by mistake.
- A rollout stops on an answer, on `max_turns` generations (compaction turns included),
  or when its context is full and no compaction is left.
- The episode (and its sandbox) is closed whatever happens.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from rlsys.config.sampling import SamplingConfig
from rlsys.engine.api import GenerationRequest, GenerationResult, Generator
from rlsys.rollout.compaction import STATE_CLOSE, CompactionConfig, extract_state, resume_prompt
from rlsys.rollout.events import EventSink
from rlsys.rollout.failures import RolloutAbort, RolloutFailure, describe, tail
from rlsys.rollout.latency import ToolLatencyConfig, tool_delay_s
from rlsys.rollout.profile import RolloutProfile, profile_trajectory
from rlsys.rollout.tasks.base import Episode, SandboxFactory, Task, Verdict
from rlsys.rollout.toolcall import TOOL_STOP_STRINGS, FinalAnswer, ToolCallError, parse_action
from rlsys.rollout.tools import ToolArgumentError, execute
from rlsys.tokenizer import ByteTokenizer
from rlsys.trajectory import Segment, Trajectory

StopReason = Literal["answer", "turn_budget", "context_budget"]
OBS_OPEN, OBS_CLOSE, TRUNCATED = "\n<obs>", "</obs>\n", "...[truncated]"


class ScaffoldConfig(BaseModel):
    """Budgets, sampling and penalties of the agent loop."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_turns: int = Field(8, ge=1, le=1024, description="Generations per rollout.")
    context_budget: int = Field(4096, ge=64, description="Most tokens in one context.")
    max_observation_tokens: int = Field(512, ge=16, description="Observations are cut here.")
    # A job always passes its own `sampling` section; the scaffold alone (demonstrations,
    # tests) keeps room for a whole file written in one action.
    sampling: SamplingConfig = Field(
        default_factory=lambda: SamplingConfig(max_tokens_per_turn=512),
        description="The job's sampling section (temperature, top-p/k, tokens per turn).",
    )
    malformed_penalty: float = Field(-0.1, le=0.0, description="Per malformed action.")
    blocked_hack_penalty: float = Field(-0.5, le=0.0, description="Per refused hack attempt.")
    rollout_timeout_s: float = Field(600.0, gt=0, description="Wall limit of one rollout.")
    compaction: CompactionConfig = Field(default_factory=CompactionConfig)
    tool_latency: ToolLatencyConfig | None = Field(
        None, description="Simulated environment delay before each observation (benchmarks)."
    )

    @property
    def max_new_tokens(self) -> int:
        """Generation budget of one turn."""
        return self.sampling.max_tokens_per_turn


@dataclass
class RolloutOutcome:
    trajectory: Trajectory
    failure: RolloutFailure | None
    stop_reason: StopReason | None  # None when it failed
    verdict: Verdict | None
    profile: RolloutProfile

    @property
    def state(self) -> str:
        """The ledger state this rollout reaches: `scored`, or its failed state."""
        return "scored" if self.failure is None else self.failure.state


@dataclass
class _Progress:
    turn: int = 0
    compactions: int = 0
    turns_in_segment: int = 0
    tool_calls: int = 0
    current: int = -1  # the turn being generated or acted on
    answer: str | None = None
    stop: StopReason | None = None


class AgentLoop:
    """Drives one episode; holds the trajectory being built. Use `run_rollout`."""

    def __init__(
        self,
        generator: Generator,
        episode: Episode,
        config: ScaffoldConfig,
        sink: EventSink,
        trajectory: Trajectory,
        session_id: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.generator, self.episode, self.config, self.sink = generator, episode, config, sink
        self.traj, self.session_id, self.clock = trajectory, session_id, clock
        self.tok = ByteTokenizer()
        self.prompt_ids = self.tok.encode(episode.instance.prompt, bos=True)
        self.instruction_ids = self.tok.encode(config.compaction.instruction)
        self.progress = _Progress()
        self.deadline = clock() + config.rollout_timeout_s
        obs_overhead = len(self.tok.encode(OBS_OPEN + TRUNCATED + OBS_CLOSE))
        self.turn_cost = config.max_new_tokens + config.max_observation_tokens + obs_overhead
        self.compaction_cost = len(self.instruction_ids) + config.compaction.max_tokens
        if len(self.prompt_ids) + self.turn_cost > config.context_budget:
            raise ValueError(
                f"context_budget: {config.context_budget} tokens cannot hold the prompt "
                f"({len(self.prompt_ids)}) and one turn ({self.turn_cost})"
            )
        self._new_segment(self.prompt_ids)

    @property
    def segment(self) -> Segment:
        return self.traj.segments[-1]

    def run(self) -> _Progress:
        p = self.progress
        while p.stop is None:
            if p.turn >= self.config.max_turns:
                p.stop = "turn_budget"
            elif not self._fits_next_turn():
                if not self._can_compact():
                    p.stop = "context_budget"
                else:
                    self._compact()
            else:
                self._action_turn()
        return p

    def _fits_next_turn(self) -> bool:
        left = self.progress.compactions < self.config.compaction.max_compactions
        reserve = self.turn_cost + (self.compaction_cost if left else 0)
        return len(self.segment.token_ids) + reserve <= self.config.context_budget

    def _can_compact(self) -> bool:
        p = self.progress
        return (
            p.compactions < self.config.compaction.max_compactions
            and p.turns_in_segment > 0  # a fresh context that cannot fit a turn stays stuck
            and len(self.segment.token_ids) + self.compaction_cost <= self.config.context_budget
        )

    def _action_turn(self) -> None:
        p, turn = self.progress, self.progress.turn
        result = self._generate(self.config.max_new_tokens, TOOL_STOP_STRINGS, "action")
        try:
            action = parse_action(self.tok.decode(result.token_ids))
            if isinstance(action, FinalAnswer):
                p.answer, p.stop = action.text, "answer"
                return
            p.tool_calls += 1
            started = self.clock()
            outcome = execute(action, self.episode.tools, self.episode.context)
        except (ToolCallError, ToolArgumentError) as err:
            kind = err.kind if isinstance(err, ToolCallError) else "bad_arguments"
            detail = err.detail if isinstance(err, ToolCallError) else str(err)
            self._penalise(turn, "malformed", self.config.malformed_penalty, f"{kind}: {detail}")
            self._observe(f"error: {err}")
            return
        data = {
            "tool": action.name,
            "blocked": outcome.blocked is not None,
            "duration_s": round(self.clock() - started, 4),
            **outcome.data,
        }
        obs_ids = self._observe(outcome.observation)
        self.sink.emit("tool_call", turn, len(obs_ids), data)
        if outcome.blocked is not None:
            self._penalise(turn, "blocked_hack", self.config.blocked_hack_penalty, outcome.blocked)
        self._check_deadline()

    def _compact(self) -> None:
        p, turn = self.progress, self.progress.turn
        before = len(self.segment.token_ids)
        self.segment.append(self.instruction_ids, turn=turn, policy=False)
        cfg = self.config.compaction
        result = self._generate(cfg.max_tokens, (STATE_CLOSE,), "compaction")
        state_ids = extract_state(result.token_ids, cfg.max_state_tokens)
        p.compactions += 1
        self._new_segment(resume_prompt(self.prompt_ids, state_ids, cfg))
        self.sink.emit(
            "compaction",
            turn,
            len(state_ids),
            {
                "context_tokens": before,
                "new_context_tokens": len(self.segment.token_ids),
                "segment": len(self.traj.segments) - 1,
                "compaction": p.compactions,
            },
        )

    def _generate(self, max_tokens: int, stops: tuple[str, ...], kind: str) -> GenerationResult:
        self._check_deadline()
        p, seg = self.progress, self.segment
        p.current = p.turn
        request = GenerationRequest(
            request_id=f"{self.traj.rollout_id}:{p.turn}",
            session_id=self.session_id,
            prompt_ids=list(seg.token_ids),
            # the job's sampling; this turn's budget (an action's, or a compaction's)
            sampling=self.config.sampling.model_copy(update={"max_tokens_per_turn": max_tokens}),
            stop_strings=stops,
        )
        try:
            result = self.generator.generate(request)
        except Exception as err:  # whatever the transport raises, the engine failed
            raise RolloutAbort("failed_engine", describe(err)) from err
        _check_result(result, self.tok)
        if result.prompt_routed_experts is not None:  # R3 over the context rows too
            seg.fill_context_routes(result.prompt_routed_experts)
        n = len(result.token_ids)
        seg.append_generation(result, turn=p.turn)
        # after the append: a superseded table also covers rows of this turn's tokens
        seg.record_request_routes(
            result.versions[-1] if result.versions else None,
            result.prompt_routed_experts,
            list(result.superseded_routes),
        )
        self.sink.emit(
            "turn",
            p.turn,
            n,
            {
                "kind": kind,
                "segment": len(self.traj.segments) - 1,
                "context_tokens": len(request.prompt_ids),
                "finish_reason": result.finish_reason,
                "prefix_cache_hit_tokens": result.prefix_cache_hit_tokens,
            },
        )
        p.turn += 1
        p.turns_in_segment += 1
        self.traj.num_turns = p.turn
        return result

    def _observe(self, text: str) -> list[int]:
        if self.config.tool_latency is not None:  # the environment answers late, never differently
            turn = self.progress.turn - 1
            time.sleep(tool_delay_s(self.config.tool_latency, self.traj.rollout_id, turn))
        body = self.tok.encode(text)
        limit = self.config.max_observation_tokens
        if len(body) > limit:
            body = body[:limit] + self.tok.encode(TRUNCATED)
        ids = [*self.tok.encode(OBS_OPEN), *body, *self.tok.encode(OBS_CLOSE)]
        self.segment.append(ids, turn=self.progress.turn - 1, policy=False)
        return ids

    def _penalise(self, turn: int, kind: str, value: float, reason: str) -> None:
        penalties = self.traj.turn_penalties
        penalties[turn] = penalties.get(turn, 0.0) + value
        tokens = sum(
            1
            for t, m in zip(self.segment.turn_index, self.segment.policy_mask, strict=True)
            if m and t == turn
        )
        self.sink.emit("penalty", turn, tokens, {"kind": kind, "value": value, "reason": reason})

    def _new_segment(self, prompt_ids: list[int]) -> None:
        segment = Segment()
        segment.append(prompt_ids, turn=-1, policy=False)
        self.traj.segments.append(segment)
        self.progress.turns_in_segment = 0

    def _check_deadline(self) -> None:
        if self.clock() > self.deadline:
            raise RolloutAbort(
                "failed_timeout", f"rollout ran past {self.config.rollout_timeout_s}s"
            )


def _check_result(result: GenerationResult, tok: ByteTokenizer) -> None:
    """Reject a result that breaks the engine contract."""
    if result.error is not None or result.finish_reason in ("error", "abort"):
        raise RolloutAbort("failed_engine", result.error or f"finish_reason={result.finish_reason}")
    n = len(result.token_ids)
    lengths = {"logprobs": len(result.logprobs), "versions": len(result.versions)}
    if result.candidate_ids:
        lengths["candidate_ids"] = len(result.candidate_ids)
    if result.routed_experts is not None:  # a list, or the engine's `TokenRoutes`
        lengths["routed_experts"] = len(result.routed_experts)
    bad = {k: v for k, v in lengths.items() if v != n}
    if bad or not all(tok.is_valid(i) for i in result.token_ids):
        raise RolloutAbort("failed_engine", f"malformed result: {n} tokens, lengths {bad}")


def run_rollout(
    task: Task,
    index: int,
    generator: Generator,
    *,
    config: ScaffoldConfig,
    sink: EventSink,
    open_sandbox: SandboxFactory,
    rollout_id: str,
    group_id: str,
    session_id: str | None = None,
) -> RolloutOutcome:
    """Run one rollout of `task` instance `index` end to end: loop, then verifier."""
    started = time.monotonic()
    instance = task.instance(index)
    traj = Trajectory(rollout_id=rollout_id, group_id=group_id, task_id=instance.task_id)
    failure: RolloutFailure | None = None
    verdict: Verdict | None = None
    progress = _Progress()
    loop: AgentLoop | None = None
    try:
        episode = task.start(instance, open_sandbox)
    except RolloutAbort as err:
        failure = RolloutFailure(err.state, err.reason)
    except Exception as err:  # the sandbox could not be opened or set up
        failure = RolloutFailure("failed_sandbox", tail(describe(err)))
    else:
        try:
            loop = AgentLoop(generator, episode, config, sink, traj, session_id or rollout_id)
            progress = loop.run()
            verdict = _score(episode, progress.answer)
        except RolloutAbort as err:
            progress = loop.progress if loop else progress
            failure = RolloutFailure(err.state, err.reason, progress.current)
        finally:
            episode.close()
    return _finish(traj, progress, loop, failure, verdict, sink, time.monotonic() - started)


def _score(episode: Episode, answer: str | None) -> Verdict:
    try:
        return episode.score(answer)
    except RolloutAbort:
        raise
    except Exception as err:  # a verifier bug is not the policy's fault: failed_reward
        raise RolloutAbort("failed_reward", describe(err)) from err


def _finish(
    traj: Trajectory,
    progress: _Progress,
    loop: AgentLoop | None,
    failure: RolloutFailure | None,
    verdict: Verdict | None,
    sink: EventSink,
    wall_s: float,
) -> RolloutOutcome:
    depth = loop.episode.context.depth if loop else None
    profile = profile_trajectory(
        traj,
        tool_calls=progress.tool_calls,
        files_touched=depth.files_touched if depth else set(),
        lines_edited=depth.lines_edited if depth else 0,
        wall_s=wall_s,
    )
    traj.metadata.update(
        profile=profile.as_dict(), stop_reason=progress.stop, answer=progress.answer
    )
    if failure is not None:
        traj.reward = math.nan  # a failed rollout has no reward (never 0)
        traj.metadata["failure"] = {"state": failure.state, "reason": failure.reason}
        sink.emit("failure", failure.turn, 0, {"state": failure.state, "reason": failure.reason})
        return RolloutOutcome(traj, failure, None, None, profile)
    assert verdict is not None
    traj.reward = verdict.reward
    traj.metadata["verdict"] = verdict.details
    sink.emit("verdict", -1, 0, {"reward": verdict.reward, **verdict.details})
    return RolloutOutcome(traj, None, progress.stop, verdict, profile)
