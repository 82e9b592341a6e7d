"""Context compaction: how a full context becomes a fresh one that starts from a state.

When the next turn would not fit the context budget, the scaffold appends a fixed
instruction (as observation ids) and lets the policy write a resumable state inside
`<state>...</state>`. That turn is an ordinary policy turn of the old segment (its tokens
carry log-probs and are trained under the rollout's reward). The new segment's prompt is
the task prompt followed by the state, wrapped in the resume header and footer.

Invariants: the state ids are a slice of the ids the engine returned (no decode and
re-encode); special ids (bos/eos/pad) are dropped from it, since they must not sit inside
a prompt; it is at most `max_state_tokens` long.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from rlsys.tokenizer import BYTE_VOCAB, ByteTokenizer

STATE_OPEN = "<state>"
STATE_CLOSE = "</state>"
TAG_SLACK_TOKENS = 32  # room for the tags around the state in the compaction turn


class CompactionConfig(BaseModel):
    """When and how a rollout compacts its context."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_compactions: int = Field(
        2, ge=0, le=64, description="Compactions per rollout; 0 stops at the context budget."
    )
    max_state_tokens: int = Field(
        256, ge=8, le=65536, description="Longest state carried into the new context."
    )
    instruction: str = Field(
        "\n<compact>The context is full. Write everything needed to continue (progress, "
        "facts, next step) as <state>...</state>.</compact>\n",
        min_length=1,
        description="Appended (as observation tokens) to ask the policy for its state.",
    )
    resume_header: str = Field(
        "\n<resume>" + STATE_OPEN, description="Between the task prompt and the state."
    )
    resume_footer: str = Field(STATE_CLOSE + "</resume>\n", description="After the state.")

    @property
    def max_tokens(self) -> int:
        """Generation budget of the compaction turn."""
        return self.max_state_tokens + TAG_SLACK_TOKENS


def extract_state(ids: list[int], max_state_tokens: int) -> list[int]:
    """The ids between <state> and </state> (or all of them when the tags are missing)."""
    tok = ByteTokenizer()
    body = [i for i in ids if 0 <= i < BYTE_VOCAB]
    start = _find(body, tok.encode(STATE_OPEN))
    if start != -1:
        body = body[start + len(STATE_OPEN) :]
        end = _find(body, tok.encode(STATE_CLOSE))
        body = body if end == -1 else body[:end]
    return body[:max_state_tokens]


def resume_prompt(
    prompt_ids: list[int], state_ids: list[int], config: CompactionConfig
) -> list[int]:
    tok = ByteTokenizer()
    return [*prompt_ids, *tok.encode(config.resume_header), *state_ids,
            *tok.encode(config.resume_footer)]  # fmt: skip


def _find(haystack: list[int], needle: list[int]) -> int:
    # Byte ids map 1:1 to bytes, so a bytes search finds the same offsets.
    return bytes(haystack).find(bytes(needle))
