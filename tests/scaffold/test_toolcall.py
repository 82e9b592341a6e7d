"""The action parser: the schema, escaping, and every malformed-input kind."""

import random

import pytest

from rlsys.rollout.toolcall import (
    FinalAnswer,
    ToolCall,
    ToolCallError,
    format_answer,
    format_tool_call,
    parse_action,
)

pytestmark = pytest.mark.unit


def test_calculator_call_is_parsed():
    assert parse_action('<tool name="calculator">2+3*4</tool>') == ToolCall("calculator", "2+3*4")


def test_attributes_and_self_closing_tag():
    assert parse_action("<tool name='read_file' path=\"a b.py\" />") == ToolCall(
        "read_file", "", {"path": "a b.py"}
    )


def test_answer_is_stripped():
    assert parse_action("thinking...\n<answer> 14 </answer>") == FinalAnswer("14")


def test_entities_are_decoded_in_body_and_attributes():
    call = parse_action('<tool name="w" path="a&amp;&quot;b">x &lt; y &gt; z &#65;&#x42;</tool>')
    assert call == ToolCall("w", "x < y > z AB", {"path": 'a&"b'})


def test_cdata_keeps_code_literally():
    code = "if a < b and c > d:\n    x = '&lt;' + \"</answer>\"\n"
    call = parse_action(f'<tool name="write_file" path="f.py"><![CDATA[{code}]]></tool>')
    assert call.body == code


def test_bare_less_than_and_ampersand_survive():
    assert (
        parse_action('<tool name="run">test 1 < 2 && echo ok</tool>').body
        == "test 1 < 2 && echo ok"
    )


def test_first_action_wins_and_trailing_text_is_ignored():
    text = '<tool name="calculator">1+1</tool> <answer>3</answer>'
    assert parse_action(text) == ToolCall("calculator", "1+1")


def test_tool_tag_prefix_is_not_a_tool():
    with pytest.raises(ToolCallError) as err:
        parse_action("<toolbox>hi</toolbox>")
    assert err.value.kind == "no_action"


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ("just words", "no_action"),
        ("", "no_action"),
        ("2+3</tool>", "unclosed_tag"),
        ('<tool name="calculator">2+3', "unclosed_tag"),
        ('<tool name="calculator"', "unclosed_tag"),
        ("<answer>14", "unclosed_tag"),
        ("<tool>2+3</tool>", "missing_name"),
        ('<tool name="">2</tool>', "missing_name"),
        ('<tool name="a b">2</tool>', "missing_name"),
        ("<tool name=calculator>2</tool>", "bad_attributes"),
        ('<tool name="a" name="b">2</tool>', "bad_attributes"),
        ('<tool name="a<b">2</tool>', "bad_attributes"),
        ('<tool name="c">1 &nbsp; 2</tool>', "bad_entity"),
        ('<tool name="c">&#0;</tool>', "bad_entity"),
        ('<tool name="c">&#x110000;</tool>', "bad_entity"),
        ('<tool name="c">&#xD800;</tool>', "bad_entity"),
        ('<tool name="w"><![CDATA[never closed</tool>', "unclosed_cdata"),
        ('<tool name="a"><tool name="b">x</tool></tool>', "nested_tag"),
        ('<tool name="a"><answer>1</answer></tool>', "nested_tag"),
    ],
)
def test_malformed_input_has_a_kind(text, kind):
    with pytest.raises(ToolCallError) as err:
        parse_action(text)
    assert err.value.kind == kind


def test_format_round_trips_hostile_strings():
    rng = random.Random(0)
    alphabet = [
        "<",
        ">",
        "&",
        '"',
        "'",
        "]]>",
        "<![CDATA[",
        "</tool>",
        "<tool",
        "&amp;",
        "a",
        " ",
        "\n",
        "é",
    ]
    for _ in range(500):
        body = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        path = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6)))
        assert parse_action(format_tool_call("write_file", body, path=path)) == ToolCall(
            "write_file", body, {"path": path}
        )


def test_answer_round_trips_markup():
    assert parse_action(format_answer("a</answer><b>")) == FinalAnswer("a</answer><b>")


def test_garbage_never_raises_anything_but_toolcallerror():
    rng = random.Random(1)
    pieces = [
        "<tool",
        " name=",
        '"x"',
        ">",
        "</tool>",
        "<![CDATA[",
        "]]>",
        "&",
        "&lt;",
        "&#",
        ";",
        "<answer>",
        "</answer>",
        "/>",
        "'",
        "\x00",
        "\ufffd",
    ]
    for _ in range(2000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 10)))
        try:
            parse_action(text)
        except ToolCallError:
            pass
