"""The generic tool format without a server: its schema, its prompt, its streaming scanner
and the OpenAI and Anthropic encoders that stream it (all sans-IO)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.schemas import ChatBody, MessagesBody, RequestLimits
from app.schemas.tools import ToolSpec, ToolUse, output_schema, system_text
from app.wire import CHAT, AnthropicEvents, OpenAIChunks, whole_message
from app.wire.openai_tools import tool_message
from app.wire.tool_call_scanner import (
    ArgumentsDelta,
    CallEnd,
    CallStart,
    TextDelta,
    ToolCallScanner,
    ToolEvent,
)
from engine import FinishEvent, FinishReason, TokenEvent
from streams import ErrorType, SSEParser

LIMITS = RequestLimits(max_prompt_chars=3000, max_new_tokens_limit=500,
                       default_max_new_tokens=8, request_policies=frozenset())
WX = ToolSpec("wx", "the weather", {"type": "object", "properties": {"c": {"type": "string"}}})
SK = ToolSpec("sk", None, {"type": "object"})


# -- the schema and the prompt --------------------------------------------------------------


def test_required_allows_only_calls_and_auto_also_a_response() -> None:
    required = output_schema(ToolUse((WX, SK), required=True))
    auto = output_schema(ToolUse((WX, SK)))

    assert required["required"] == ["tool_calls"]
    items = required["properties"]["tool_calls"]["items"]["anyOf"]
    assert [i["properties"]["name"]["const"] for i in items] == ["wx", "sk"]
    assert items[0]["properties"]["arguments"] == WX.parameters
    assert auto["anyOf"][0] == required
    assert auto["anyOf"][1]["properties"] == {"response": {"type": "string"}}


def test_a_named_function_is_the_only_item_and_no_parallel_means_one() -> None:
    schema = output_schema(ToolUse((WX, SK), required=True, named="sk", parallel=False))

    calls = schema["properties"]["tool_calls"]
    assert calls["items"]["properties"]["name"] == {"type": "string", "const": "sk"}
    assert (calls["minItems"], calls["maxItems"]) == (1, 1)


def test_a_named_function_is_called_once_even_with_parallel_calls_allowed() -> None:
    """As OpenAI and vLLM: ``parallel_tool_calls`` governs auto and required only."""
    named = output_schema(ToolUse((WX, SK), required=True, named="sk", parallel=True))
    required = output_schema(ToolUse((WX, SK), required=True, parallel=True))

    assert named["properties"]["tool_calls"]["maxItems"] == 1
    assert "maxItems" not in required["properties"]["tool_calls"]


def test_the_system_turn_lists_every_tool_and_the_answer_format() -> None:
    text = system_text(ToolUse((WX, SK), required=True, named="sk"))

    listed = json.loads(text.split("Tools: ", 1)[1])
    assert [t["name"] for t in listed] == ["wx", "sk"]
    assert listed[0]["parameters"] == WX.parameters
    assert '{"tool_calls"' in text and '"sk"' in text.split("\n")[0]
    assert '"response"' in system_text(ToolUse((WX,)))
    assert '"response"' not in system_text(ToolUse((WX,), required=True))


def openai_body(**fields: Any) -> ChatBody:
    return ChatBody.model_validate_json(json.dumps({"messages": [], **fields}),
                                        context=LIMITS)


def test_an_openai_round_trip_renders_as_the_model_wrote_it() -> None:
    tool = {"type": "function", "function": {"name": "wx", "parameters": WX.parameters}}
    body = openai_body(tools=[tool], messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "wx", "arguments": '{"c": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ])

    turns = body.template_input()
    assert [t["role"] for t in turns] == ["system", "user", "assistant", "user"]
    assert turns[0]["content"].startswith("Be brief.\n\nAnswer with one JSON object")
    assert json.loads(turns[2]["content"]) == {
        "tool_calls": [{"name": "wx", "arguments": {"c": "Paris"}}]}
    assert json.loads(turns[3]["content"]) == {
        "tool_response": {"tool_call_id": "call_1", "name": "wx", "content": "sunny"}}
    assert body.constraint() is not None


def test_tool_choice_none_shows_no_tools_and_constrains_nothing() -> None:
    tool = {"type": "function", "function": {"name": "wx"}}
    body = openai_body(tools=[tool], tool_choice="none",
                       messages=[{"role": "user", "content": "Hi"}])

    assert body.template_input() == [{"role": "user", "content": "Hi"}]
    assert body.constraint() is None


def test_an_anthropic_round_trip_renders_tool_blocks_in_order() -> None:
    body = MessagesBody.model_validate_json(json.dumps({
        "model": "m", "max_tokens": 4,
        "tools": [{"name": "wx", "input_schema": WX.parameters}],
        "messages": [
            {"role": "user", "content": "Paris?"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Looking."},
                {"type": "tool_use", "id": "toolu_1", "name": "wx", "input": {"c": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny",
                 "is_error": True}]},
        ]}), context=LIMITS)

    turns = body.template_input()
    said, calls = turns[2]["content"].split("\n")
    assert said == "Looking."
    assert json.loads(calls) == {"tool_calls": [{"name": "wx", "arguments": {"c": "Paris"}}]}
    assert json.loads(turns[3]["content"]) == {"tool_response": {
        "tool_call_id": "toolu_1", "name": "wx", "content": "sunny", "is_error": True}}
    assert turns[0]["role"] == "system"


# -- the scanner ----------------------------------------------------------------------------

ANSWERS = [
    {"tool_calls": [{"name": "wx", "arguments": {"c": 'Pa"ris\n', "n": [1, 2.5e3, None]}},
                    {"name": "sk", "arguments": {}}]},
    {"response": "hi \U0001f600 there\n\"q\" \u2028"},
    {"response": {"a": [1, True, "x"]}},
]


def scan(text: str, cuts: list[int]) -> tuple[ToolCallScanner, list[ToolEvent]]:
    scanner, events, at = ToolCallScanner(), [], 0
    for cut in [*sorted(cuts), len(text)]:
        events += scanner.feed(text[at:cut])
        at = max(at, cut)
    return scanner, events + scanner.end()


def calls_of(events: list[ToolEvent]) -> list[tuple[str, str]]:
    calls: dict[int, list[str]] = {}
    for event in events:
        if isinstance(event, CallStart):
            calls[event.index] = [event.name, ""]
        elif isinstance(event, ArgumentsDelta):
            calls[event.index][1] += event.fragment
    return [(name, arguments) for name, arguments in calls.values()]


@settings(max_examples=200, deadline=None)
@given(answer=st.sampled_from(ANSWERS), ascii_only=st.booleans(), indent=st.sampled_from(
    [None, 1]), cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=30))
def test_any_cut_of_an_answer_scans_to_the_same_calls_and_text(
    answer: dict[str, Any], ascii_only: bool, indent: int | None, cuts: list[int],
) -> None:
    text = json.dumps(answer, ensure_ascii=ascii_only, indent=indent)
    scanner, events = scan(text, cuts)

    if "tool_calls" in answer:
        calls = calls_of(events)
        assert [name for name, _ in calls] == [c["name"] for c in answer["tool_calls"]]
        assert [json.loads(a) for _, a in calls] == [c["arguments"] for c in answer["tool_calls"]]
        assert [e.index for e in events if isinstance(e, CallEnd)] == [0, 1]
        assert scanner.made_calls
    else:
        said = "".join(e.text for e in events if isinstance(e, TextDelta))
        response = answer["response"]
        assert said == response if isinstance(response, str) else json.loads(said) == response
        assert not scanner.made_calls


def test_a_cut_answer_ends_its_open_call() -> None:
    _, events = scan('{"tool_calls": [{"name": "wx", "arguments": {"c": "Pa', [])

    assert events == [CallStart(0, "wx"), ArgumentsDelta(0, '{"c": "Pa'), CallEnd(0)]


# -- the encoders ---------------------------------------------------------------------------

CALL = '{"tool_calls": [{"name": "wx", "arguments": {"c": "P"}}]}'


def tokens(text: str, size: int = 3) -> list[TokenEvent]:
    return [TokenEvent("r", i, i, text[at:at + size])
            for i, at in enumerate(range(0, len(text), size))]


def finish(reason: FinishReason = FinishReason.STOP) -> FinishEvent:
    return FinishEvent("r", reason, prompt_tokens=5, completion_tokens=9)


def openai_deltas(text: str, reason: FinishReason = FinishReason.STOP) -> list[dict[str, Any]]:
    chunks = OpenAIChunks(CHAT, "r", "m", error_envelope=_envelope,
                          tools=True)
    raw = chunks.opening() + chunks.encode([*tokens(text), finish(reason)])
    events = SSEParser().feed(raw)
    return [json.loads(e.data)["choices"][0] for e in events if e.data != "[DONE]"]


def _envelope(kind: ErrorType, message: str) -> dict[str, Any]:
    return {"error": {"type": kind.value, "message": message}}


def test_openai_chunks_send_a_call_as_openai_does() -> None:
    choices = openai_deltas(CALL)

    calls = [c["delta"]["tool_calls"][0] for c in choices[1:-1]]
    assert calls[0] == {"index": 0, "id": "call_r_0", "type": "function",
                        "function": {"name": "wx", "arguments": ""}}
    assert "".join(c["function"]["arguments"] for c in calls[1:]) == '{"c": "P"}'
    assert choices[-1] == {"index": 0, "delta": {}, "logprobs": None,
                           "finish_reason": "tool_calls"}


def test_openai_chunks_send_a_response_as_content_and_a_cut_call_as_length() -> None:
    text = openai_deltas('{"response": "Hi \\"you\\""}')
    cut = openai_deltas(CALL[:40], FinishReason.LENGTH)

    assert "".join(c["delta"].get("content", "") for c in text[1:]) == 'Hi "you"'
    assert text[-1]["finish_reason"] == "stop"
    assert cut[-1]["finish_reason"] == "length"


def test_a_whole_openai_answer_has_tool_calls_and_no_content() -> None:
    message, called = tool_message("r", CALL)

    assert called and message["content"] is None
    assert message["tool_calls"] == [{"id": "call_r_0", "type": "function",
                                      "function": {"name": "wx", "arguments": '{"c": "P"}'}}]
    assert tool_message("r", '{"response": "Hi"}')[0]["content"] == "Hi"


def anthropic_events(text: str) -> list[tuple[str | None, dict[str, Any]]]:
    events = AnthropicEvents("r", "m", 5, error_envelope=_envelope, tools=True)
    raw = events.opening() + events.encode([*tokens(text), finish()])
    return [(e.event, json.loads(e.data)) for e in SSEParser().feed(raw)]


def test_anthropic_events_send_a_tool_use_block() -> None:
    events = anthropic_events(CALL)

    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert events[2][1]["content_block"] == {"type": "tool_use", "id": "toolu_r_0",
                                             "name": "wx", "input": {}}
    deltas = [d["delta"] for n, d in events if n == "content_block_delta"]
    assert "".join(d["partial_json"] for d in deltas) == '{"c": "P"}'
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_anthropic_events_send_a_response_as_one_text_block() -> None:
    events = anthropic_events('{"response": "Hi"}')

    assert events[2][1]["content_block"] == {"type": "text", "text": ""}
    assert [d["delta"]["text"] for n, d in events if n == "content_block_delta"] == ["H", "i"]
    assert events[-2][1]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}


@pytest.mark.parametrize(("text", "blocks"), [
    (CALL, [{"type": "tool_use", "id": "toolu_r_0", "name": "wx", "input": {"c": "P"}}]),
    ('{"response": "Hi"}', [{"type": "text", "text": "Hi"}]),
])
def test_a_whole_anthropic_message(text: str, blocks: list[dict[str, Any]]) -> None:
    message = whole_message("r", "m", text, finish(), tools=True)

    assert message["content"] == blocks
    assert message["stop_reason"] == ("tool_use" if "tool_calls" in text else "end_turn")
