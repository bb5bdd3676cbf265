"""Tool calls in a model's own format, without a server: which format a chat template
speaks, what its answer's grammar says, and the scanner that reads its answers back into
the generic scanner's events (``app.schemas.tool_formats``, ``app.wire.tool_formats``).

The answers are literal texts as each family's models write them; each is also fed in
two pieces split at every position, which must give the same calls and text as whole.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from app.schemas.tool_formats import (
    FRAMINGS,
    GENERIC,
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    answer_constraint,
    calls_writer,
    request_format,
    template_tool_format,
    template_tools,
    with_tools,
)
from app.schemas.tools import ANSWER_FORMAT, ToolSpec, ToolUse
from app.wire.tool_call_scanner import (
    ArgumentsDelta,
    CallEnd,
    CallStart,
    TextDelta,
    ToolCallScanner,
)
from app.wire.tool_formats import SYNTAXES, FormatScanner, tool_scanner
from engine import ConstraintKind
from tests.tool_templates import CHATML, HERMES_TEMPLATE, LLAMA3_TEMPLATE, MISTRAL_TEMPLATE

WX = ToolSpec("wx", "The weather.", {"type": "object", "properties": {
    "c": {"enum": ["P", "R"]}, "d": {"type": "integer"}}, "required": ["c", "d"]})
SUM = ToolSpec("sum", None, {"type": "object", "properties": {"x": {"type": "integer"}}})


class Template:
    """A chat template as ``Engine.chat_template_uses`` reads it."""

    def __init__(self, text: str) -> None:
        self.text = text

    def chat_template_uses(self, name: str) -> bool:
        return name in self.text


def read(fmt: str, *pieces: str) -> tuple[str, list[tuple[str, str]], list[Any]]:
    """The text, the calls (name, arguments) and the events of an answer fed in pieces."""
    scanner = tool_scanner(fmt)
    events = [e for piece in pieces for e in scanner.feed(piece)] + scanner.end()
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    names = {e.index: e.name for e in events if isinstance(e, CallStart)}
    arguments: dict[int, str] = {}
    for event in events:
        if isinstance(event, ArgumentsDelta):
            arguments[event.index] = arguments.get(event.index, "") + event.fragment
    return text, [(names[i], arguments.get(i, "")) for i in sorted(names)], events


# -- which format a template speaks ------------------------------------------------------


@pytest.mark.parametrize(("template", "expected"), [
    (HERMES_TEMPLATE, HERMES), (LLAMA3_TEMPLATE, LLAMA3_JSON), (MISTRAL_TEMPLATE, MISTRAL),
    (CHATML, GENERIC),
])
def test_a_template_speaks_its_family_s_tool_format(template: str, expected: str) -> None:
    assert template_tool_format(Template(template)) == expected


def test_a_template_that_renders_tools_in_no_known_syntax_keeps_the_generic_format() -> None:
    template = "{% for t in tools %}{{ t | tojson }}{% endfor %}{{ messages[0]['content'] }}"

    assert template_tool_format(Template(template)) == GENERIC
    assert template_tool_format(None) == GENERIC


def test_both_sides_know_the_same_formats() -> None:
    assert set(FRAMINGS) == set(SYNTAXES)
    for name, framing in FRAMINGS.items():
        assert framing.arguments_key == SYNTAXES[name].arguments_key


# -- the request in the model's format ---------------------------------------------------


def test_a_native_format_sends_the_tools_to_the_template_and_no_generic_text() -> None:
    use = request_format(HERMES, ToolUse((WX,), required=True))
    turns = [{"role": "user", "content": "Hi"}]

    assert use is not None and use.format == HERMES
    assert with_tools(turns, use) == turns
    assert template_tools(use) == [{"type": "function", "function": {
        "name": "wx", "description": "The weather.", "parameters": dict(WX.parameters)}}]


def test_the_generic_format_is_unchanged_for_a_template_without_tools() -> None:
    use = request_format(GENERIC, ToolUse((WX,), required=True))
    turns = [{"role": "user", "content": "Hi"}]

    assert use == ToolUse((WX,), required=True)
    assert template_tools(use) is None
    assert ANSWER_FORMAT in with_tools(turns, use)[0]["content"]
    assert answer_constraint(use).kind is ConstraintKind.JSON_SCHEMA


def test_auto_with_a_response_format_keeps_the_generic_format() -> None:
    use = ToolUse((WX,), response_schema={"type": "object"})

    assert request_format(HERMES, use) == use


def test_the_grammar_asks_for_the_family_s_framing_and_one_call_when_named() -> None:
    named = answer_constraint(ToolUse((WX, SUM), required=True, named="sum", format=HERMES))
    parallel = answer_constraint(ToolUse((WX, SUM), required=True, format=MISTRAL))
    auto = answer_constraint(ToolUse((WX,), format=LLAMA3_JSON))

    assert named.kind is ConstraintKind.GRAMMAR
    assert named.source.startswith("start: calls\n")
    assert '"<tool_call>\\n"' in named.source and '"\\n</tool_call>"' in named.source
    assert "call)*" not in named.source and '"wx"' not in named.source
    assert '"[TOOL_CALLS] ["' in parallel.source and '(", " call)*' in parallel.source
    assert auto.source.startswith("start: text | calls\n")
    assert '"parameters"' in auto.source


@pytest.mark.parametrize(("fmt", "written"), [
    (HERMES, '<tool_call>\n{"name": "wx", "arguments": {"c": "P", "d": 2}}\n</tool_call>\n'
             '<tool_call>\n{"name": "sum", "arguments": {}}\n</tool_call>'),
    (LLAMA3_JSON, '{"name": "wx", "parameters": {"c": "P", "d": 2}}; '
                  '{"name": "sum", "parameters": {}}'),
    (MISTRAL, '[TOOL_CALLS] [{"name": "wx", "arguments": {"c": "P", "d": 2}}, '
              '{"name": "sum", "arguments": {}}]'),
])
def test_past_calls_are_written_as_the_family_writes_them_and_read_back(
    fmt: str, written: str,
) -> None:
    calls = [("wx", {"c": "P", "d": 2}), ("sum", {})]
    write = calls_writer(ToolUse((WX, SUM), format=fmt), GENERIC)

    assert write(calls, "") == written
    assert read(fmt, written)[1] == [(name, json.dumps(args)) for name, args in calls]
    assert calls_writer(None, fmt)(calls, "Sure.") == f"Sure.\n{written}"


def test_past_calls_stay_generic_where_the_answer_is() -> None:
    write = calls_writer(ToolUse((WX,), response_schema={"type": "object"}), HERMES)

    assert write([("wx", {"c": "P"})], "") == (
        '{"tool_calls": [{"name": "wx", "arguments": {"c": "P"}}]}')


# -- reading answers ---------------------------------------------------------------------

HERMES_TWO = ('Let me look.\n<tool_call>\n{"name": "wx", "arguments": {"c": "P", "d": 2}}\n'
              '</tool_call>\n<tool_call>\n{"name": "sum", "arguments": {"x": "a}\\"{"}}\n'
              '</tool_call>')
LLAMA_TWO = '{"name": "wx", "parameters": {"c": "R", "d": 7}}; {"name": "sum", "parameters": {}}'
MISTRAL_TWO = ('[TOOL_CALLS] [{"name": "wx", "arguments": {"c": "P", "d": 1}}, '
               '{"arguments": {"x": [1, {"y": "]"}]}, "name": "sum"}]')

ANSWERS = [
    (HERMES, HERMES_TWO, "Let me look.\n",
     [("wx", '{"c": "P", "d": 2}'), ("sum", '{"x": "a}\\"{"}')]),
    (HERMES, "The weather is <b>fine</b> < tool_call", "The weather is <b>fine</b> < tool_call",
     []),
    (LLAMA3_JSON, LLAMA_TWO, "", [("wx", '{"c": "R", "d": 7}'), ("sum", "{}")]),
    (LLAMA3_JSON, '<|python_tag|>{"name": "wx", "parameters": {"c": "P", "d": 3}}', "",
     [("wx", '{"c": "P", "d": 3}')]),
    (LLAMA3_JSON, "It is {sunny} today.", "It is {sunny} today.", []),
    (MISTRAL, MISTRAL_TWO, "", [("wx", '{"c": "P", "d": 1}'), ("sum", '{"x": [1, {"y": "]"}]}')]),
    (MISTRAL, "[TOOL] is not [TOOL_CALLS]", "[TOOL] is not [TOOL_CALLS]", []),
]


@pytest.mark.parametrize(("fmt", "answer", "text", "calls"), ANSWERS)
def test_an_answer_in_a_family_s_format_gives_its_text_and_calls(
    fmt: str, answer: str, text: str, calls: list[tuple[str, str]],
) -> None:
    said, made, events = read(fmt, answer)

    assert (said, made) == (text, calls)
    assert [e.index for e in events if isinstance(e, CallEnd)] == list(range(len(calls)))
    assert all(json.loads(arguments) is not None for _, arguments in made)


@pytest.mark.parametrize(("fmt", "answer", "text", "calls"), ANSWERS)
def test_an_answer_split_at_any_position_reads_as_whole(
    fmt: str, answer: str, text: str, calls: list[tuple[str, str]],
) -> None:
    for at in range(len(answer) + 1):
        said, made, _ = read(fmt, answer[:at], answer[at:])
        assert (said, made) == (text, calls), at


def test_an_answer_fed_character_by_character_streams_each_call_s_name_first() -> None:
    scanner = tool_scanner(HERMES)
    events = [e for ch in HERMES_TWO for e in scanner.feed(ch)] + scanner.end()
    kinds = [type(e).__name__ for e in events if not isinstance(e, TextDelta)]

    assert kinds[0] == "CallStart" and kinds.count("CallStart") == 2
    assert kinds.index("ArgumentsDelta") > kinds.index("CallStart")
    assert scanner.made_calls


def test_a_call_cut_short_ends_with_the_arguments_it_had() -> None:
    said, made, events = read(MISTRAL, '[TOOL_CALLS] [{"name": "wx", "arguments": {"c": "P"')

    assert (said, made) == ("", [("wx", '{"c": "P"')])
    assert isinstance(events[-1], CallEnd)


def test_text_held_as_a_possible_marker_is_text_at_the_end() -> None:
    assert read(HERMES, "See <tool_")[0] == "See <tool_"
    assert read(MISTRAL, "[TOOL_C")[0] == "[TOOL_C"


def test_the_scanner_is_chosen_by_the_format_s_name() -> None:
    assert isinstance(tool_scanner(HERMES), FormatScanner)
    for generic in (True, GENERIC):
        scanner = tool_scanner(generic)
        assert type(scanner) is ToolCallScanner
