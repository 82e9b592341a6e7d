"""Parse the agent's action out of one generated turn: a tool call or a final answer.

The schema is XML-style, one action per turn:

    <tool name="calculator">2+3*4</tool>
    <tool name="write_file" path="f.py"><![CDATA[if a < b and c > d: ...]]></tool>
    <tool name="read_file" path="f.py"/>
    <answer>14</answer>

Escaping: in attribute values and bodies the entities &lt; &gt; &amp; &quot; &apos; and
numeric &#NN; / &#xHH; are decoded; a CDATA section is taken literally (the way to send
code). Outside CDATA a bare `<` or `&` that starts no tag or entity is kept as text, so
`a < b` and `x & y` survive; only `</tool>` (or `</answer>`) ends the body.

Invariants:
- `parse_action` returns the first action in the text; anything after its closing tag is
  ignored (the engine stops at the closing tag, so normally nothing follows).
- Every malformed input raises `ToolCallError` with a `kind` from `ParseErrorKind`; the
  parser never raises anything else.
- `format_tool_call` is the inverse: `parse_action(format_tool_call(n, b, **a))` gives back
  exactly `n`, `b` and `a` for any strings.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

ParseErrorKind = Literal[
    "no_action",  # neither <tool> nor <answer> in the turn
    "unclosed_tag",  # an opening tag or body that never closes
    "bad_attributes",  # attribute syntax we cannot read, or a duplicate attribute
    "missing_name",  # <tool> without name="..."
    "bad_entity",  # &name; we do not know, or a numeric entity out of range
    "unclosed_cdata",  # <![CDATA[ without ]]>
    "nested_tag",  # <tool>/<answer> opened inside an action body (outside CDATA)
]

ACTION_TAGS = ("tool", "answer")
TOOL_STOP_STRINGS = ("</tool>", "</answer>")  # where a turn's generation should stop

_NAMED_ENTITIES = {"lt": "<", "gt": ">", "amp": "&", "quot": '"', "apos": "'"}
_ENTITY = re.compile(r"&(#[0-9]{1,8}|#[xX][0-9a-fA-F]{1,8}|[A-Za-z][A-Za-z0-9]{0,31});")
_CLOSE_ANY = re.compile(r"</(tool|answer)\s*>")
_OPEN = re.compile(r"<(tool|answer)(?=[\s/>]|$)")
_ATTR = re.compile(r"\s+([A-Za-z_][\w.-]*)\s*=\s*(\"[^\"<]*\"|'[^'<]*')")
_CDATA_OPEN = "<![CDATA["
_CDATA_CLOSE = "]]>"
_NAME = re.compile(r"^[A-Za-z_][\w.-]*$")


class ToolCallError(ValueError):
    """A malformed action; `kind` says which rule it broke, the message says where."""

    def __init__(self, kind: ParseErrorKind, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind: ParseErrorKind = kind
        self.detail = message


@dataclass(frozen=True)
class ToolCall:
    name: str
    body: str
    attrs: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class FinalAnswer:
    text: str


Action = ToolCall | FinalAnswer


def parse_action(text: str) -> Action:
    """The first action in `text`; raises `ToolCallError` when there is none or it is malformed."""
    match = _OPEN.search(text)
    if match is None:
        if _CLOSE_ANY.search(text):
            raise ToolCallError("unclosed_tag", "a closing tag without its opening tag")
        raise ToolCallError("no_action", 'expected <tool name="..."> ... </tool> or <answer>')
    tag = match.group(1)
    attrs, body_start, self_closing = _parse_open_tag(text, match.end(), tag)
    body = "" if self_closing else _parse_body(text, body_start, tag)
    if tag == "answer":
        return FinalAnswer(text=body.strip())
    name = attrs.pop("name", None)
    if name is None:
        raise ToolCallError("missing_name", '<tool> needs a name="..." attribute')
    if not _NAME.match(name):
        raise ToolCallError("missing_name", f"tool name {name!r} is not an identifier")
    return ToolCall(name=name, body=body, attrs=attrs)


def _parse_open_tag(text: str, pos: int, tag: str) -> tuple[dict[str, str], int, bool]:
    """Attributes of the opening tag at `pos`; returns (attrs, body start, self-closing)."""
    attrs: dict[str, str] = {}
    while True:
        rest = text[pos:]
        stripped = rest.lstrip()
        skipped = len(rest) - len(stripped)
        if stripped.startswith("/>"):
            return attrs, pos + skipped + 2, True
        if stripped.startswith(">"):
            return attrs, pos + skipped + 1, False
        if not stripped:
            raise ToolCallError("unclosed_tag", f"<{tag} ... never ends with '>'")
        attr = _ATTR.match(text, pos)
        if attr is None:
            raise ToolCallError("bad_attributes", f"cannot read attribute at {stripped[:30]!r}")
        key, raw = attr.group(1), attr.group(2)[1:-1]
        if key in attrs:
            raise ToolCallError("bad_attributes", f"attribute {key!r} given twice")
        attrs[key] = decode_entities(raw)
        pos = attr.end()


def _parse_body(text: str, pos: int, tag: str) -> str:
    """Decoded body from `pos` up to `</tag>`: entity-decoded text and literal CDATA."""
    close = re.compile(rf"</{tag}\s*>")
    parts: list[str] = []
    while True:
        end = close.search(text, pos)
        stop = end.start() if end else len(text)
        cdata = text.find(_CDATA_OPEN, pos, stop)
        nested = _OPEN.search(text, pos, stop)
        if cdata != -1 and (nested is None or cdata < nested.start()):
            parts.append(decode_entities(text[pos:cdata]))
            cdata_end = text.find(_CDATA_CLOSE, cdata + len(_CDATA_OPEN))
            if cdata_end == -1:
                raise ToolCallError("unclosed_cdata", "<![CDATA[ without ]]>")
            parts.append(text[cdata + len(_CDATA_OPEN) : cdata_end])
            pos = cdata_end + len(_CDATA_CLOSE)
            continue
        if nested is not None:
            raise ToolCallError("nested_tag", f"<{nested.group(1)}> opened inside <{tag}>")
        if end is None:
            raise ToolCallError("unclosed_tag", f"<{tag}> has no </{tag}>")
        parts.append(decode_entities(text[pos : end.start()]))
        return "".join(parts)


def decode_entities(text: str) -> str:
    """Decode the five XML entities and numeric references; a bare `&` stays as text."""

    def one(match: re.Match[str]) -> str:
        ref = match.group(1)
        if ref[0] != "#":
            if ref not in _NAMED_ENTITIES:
                raise ToolCallError("bad_entity", f"unknown entity &{ref};")
            return _NAMED_ENTITIES[ref]
        code = int(ref[2:], 16) if ref[1] in "xX" else int(ref[1:])
        if code == 0 or code > 0x10FFFF or 0xD800 <= code <= 0xDFFF:
            raise ToolCallError("bad_entity", f"&{ref}; is not a character")
        return chr(code)

    return _ENTITY.sub(one, text)


def escape_attribute(value: str) -> str:
    return (
        value.replace("&", "&amp;")
        .replace("<", "&lt;")
        .replace('"', "&quot;")
        .replace("'", "&apos;")
    )


def escape_body(body: str) -> str:
    """Body text that parses back to `body`: plain when safe, else CDATA sections."""
    if not any(c in body for c in "<&>"):
        return body
    # "]]>" cannot appear inside one CDATA section: split it across two.
    return _CDATA_OPEN + body.replace(_CDATA_CLOSE, "]]]]><![CDATA[>") + _CDATA_CLOSE


def format_tool_call(name: str, body: str = "", **attrs: str) -> str:
    """The canonical text of a tool call (used for demonstrations and tests)."""
    attr_text = "".join(f' {k}="{escape_attribute(v)}"' for k, v in attrs.items())
    return f'<tool name="{escape_attribute(name)}"{attr_text}>{escape_body(body)}</tool>'


def format_answer(text: str) -> str:
    return f"<answer>{escape_body(text)}</answer>"
