"""Tool-use arithmetic: compute a*b+c with a calculator tool; reward 1 for the exact answer.

Built so that a `small` byte-level model can learn it on CPU in minutes: the winning
policy is two short turns that copy digits (the expression into the calculator, the
calculator's output into the answer). A random policy scores ~0: the answer has up to
five digits and must sit inside well-formed `<answer>` tags. Headroom comes from the
format (two well-formed calls) and from exact copying of multi-digit numbers.

Invariants: an instance is a pure function of its index (no global RNG); the reward is
1.0 exactly when the answer parses as the integer a*b+c, else 0.0.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rlsys.rollout.tasks.base import SandboxFactory, TaskInstance, Verdict
from rlsys.rollout.toolcall import format_answer, format_tool_call
from rlsys.rollout.tools import Tool, ToolContext, select_tools

DIGIT_IDS = frozenset(b"0123456789")  # byte-level token ids of the digits


class ArithmeticTaskConfig(BaseModel):
    """Ranges of the operands of a*b+c."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["arithmetic"] = "arithmetic"
    min_factor: int = Field(2, ge=0, description="Smallest a and b.")
    max_factor: int = Field(99, ge=1, le=10**6, description="Largest a and b.")
    max_addend: int = Field(99, ge=0, le=10**6, description="Largest c (smallest is 0).")
    instructions: bool = Field(
        True,
        description=(
            "Spell out the tool protocol in the prompt. A policy trained from scratch cannot "
            "read it (the warm start teaches the protocol), and it costs ~70 tokens a turn."
        ),
    )

    @model_validator(mode="after")
    def _ordered(self) -> ArithmeticTaskConfig:
        if self.min_factor > self.max_factor:
            raise ValueError("min_factor: must not exceed max_factor")
        return self


class ArithmeticEpisode:
    def __init__(self, instance: TaskInstance) -> None:
        self.instance = instance
        self.tools: Mapping[str, Tool] = select_tools(("calculator",))
        self.context = ToolContext(sandbox=None)

    def score(self, answer: str | None) -> Verdict:
        expected = int(self.instance.data["result"])
        try:
            correct = answer is not None and int(answer.strip()) == expected
        except ValueError:
            correct = False
        return Verdict(1.0 if correct else 0.0, {"expected": expected, "answer": answer})

    def close(self) -> None:
        return None


class ArithmeticTask:
    name = "arithmetic"

    def __init__(self, config: ArithmeticTaskConfig | None = None) -> None:
        self.config = config or ArithmeticTaskConfig()

    def instance(self, index: int) -> TaskInstance:
        cfg = self.config
        rng = random.Random(f"{self.name}:{index}")
        a = rng.randint(cfg.min_factor, cfg.max_factor)
        b = rng.randint(cfg.min_factor, cfg.max_factor)
        c = rng.randint(0, cfg.max_addend)
        # Instructions first, question last: the operands sit a short, fixed distance
        # before the policy's first turn, where a small model learns to copy them soonest.
        prompt = f"Compute {a}*{b}+{c}.\n"
        if cfg.instructions:
            prompt = 'Use <tool name="calculator">expression</tool>, then reply ' + (
                f"<answer>number</answer>.\n{prompt}"
            )
        data = {"a": a, "b": b, "c": c, "result": a * b + c}
        return TaskInstance(self.name, index, prompt, data)

    def start(self, instance: TaskInstance, open_sandbox: SandboxFactory) -> ArithmeticEpisode:
        return ArithmeticEpisode(instance)  # the calculator needs no sandbox

    def oracle_turns(self, instance: TaskInstance) -> list[str]:
        d = instance.data
        return [
            format_tool_call("calculator", f"{d['a']}*{d['b']}+{d['c']}"),
            format_answer(str(d["result"])),
        ]

    def slip_turns(self, instance: TaskInstance, rng: random.Random) -> list[str]:
        """A well-formed attempt at the wrong expression, whose output is then copied
        faithfully: the addend forgotten (a*b), or when that is still right (c = 0) the
        wrong operator (a+b+c), or when even that is right (2*2+0) a slip in copying the
        answer. Copying stays consistent across demonstrations, so a warm start learns it
        as fast as from the oracle; the mistake is one decision RL can find."""
        d = instance.data
        a, b, c, result = d["a"], d["b"], d["c"], d["result"]
        for expression, value in ((f"{a}*{b}", a * b), (f"{a}+{b}+{c}", a + b + c)):
            if value != result:
                return [format_tool_call("calculator", expression), format_answer(str(value))]
        digits = list(str(result))
        at = rng.randrange(len(digits))
        banned = {digits[at]} | ({"0"} if at == 0 and len(digits) > 1 else set())
        digits[at] = rng.choice([x for x in "0123456789" if x not in banned])
        return [self.oracle_turns(instance)[0], format_answer("".join(digits))]

    @property
    def content_token_ids(self) -> frozenset[int]:
        return DIGIT_IDS
