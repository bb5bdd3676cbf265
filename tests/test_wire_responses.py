"""The Responses API's events (``app/wire/responses_events.py``), without a server: numbered
from 0 by one, typed, parsed by the openai SDK's own decoder and event models."""

from __future__ import annotations

import itertools
import json
from typing import Any

from openai._streaming import SSEDecoder
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from app.wire.output_parser import OutputEvent, PlainText
from app.wire.responses_events import ResponseEvents
from app.wire.tool_call_scanner import ArgumentsDelta, CallStart
from engine import FinishEvent, FinishReason, TokenEvent, TokenLogprobs
from streams import ErrorType, StreamError

EVENTS = TypeAdapter(ResponseStreamEvent)


def response_object() -> dict[str, Any]:
    return {"id": "resp_1", "object": "response", "created_at": 1, "model": "smollm2",
            "status": "queued", "output": [], "parallel_tool_calls": True,
            "tool_choice": "auto", "tools": [], "error": None, "incomplete_details": None,
            "instructions": None, "metadata": {}, "temperature": 1.0, "top_p": 1.0}


def encoder(parser: Any = None, skip_through: int = -1) -> ResponseEvents:
    counter = itertools.count()
    return ResponseEvents(response_object(), parser or PlainText(),
                          lambda prefix: f"{prefix}_{next(counter)}", skip_through=skip_through)


def tokens(*texts: str) -> list[TokenEvent]:
    return [TokenEvent("r", i, 100 + i, text) for i, text in enumerate(texts)]


def decode(data: bytes) -> list[dict[str, Any]]:
    """Each event as the SDK's decoder dispatches it, its data parsed, its name checked."""
    events = []
    for sse in SSEDecoder().iter_bytes(iter([data])):
        body = sse.json()
        assert sse.event == body["type"]
        events.append(body)
    return events


def whole(enc: ResponseEvents, items: list[Any]) -> list[dict[str, Any]]:
    return decode(enc.opening() + enc.encode(items))


def test_a_text_answer_is_the_documented_sequence_numbered_from_zero() -> None:
    finish = FinishEvent("r", FinishReason.EOS, prompt_tokens=5, completion_tokens=3,
                         cached_tokens=4)
    events = whole(encoder(), [*tokens("Par", "is", ""), finish])

    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for event in events:
        EVENTS.validate_python(event)  # every body is the SDK's model of its type
    final = events[-1]["response"]
    assert final["status"] == "completed"
    assert final["output"][0]["content"][0]["text"] == "Paris"
    assert final["usage"]["total_tokens"] == 8
    assert final["usage"]["input_tokens_details"]["cached_tokens"] == 4
    assert events[0]["response"]["status"] == "queued"


def test_max_output_tokens_ends_incomplete_with_its_reason() -> None:
    finish = FinishEvent("r", FinishReason.LENGTH, prompt_tokens=2, completion_tokens=1)
    events = whole(encoder(), [*tokens("a"), finish])

    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-2]["item"]["status"] == "incomplete"


def test_log_probabilities_ride_on_their_delta_and_the_done_text() -> None:
    lp = TokenLogprobs("Hi", -0.5, ((7, "Hi", -0.5), (8, "Ho", -1.5)))
    finish = FinishEvent("r", FinishReason.EOS, prompt_tokens=1, completion_tokens=1)
    events = whole(encoder(PlainText(with_logprobs=True)),
                   [TokenEvent("r", 0, 7, "Hi", lp), finish])

    (delta,) = [e for e in events if e["type"] == "response.output_text.delta"]
    assert delta["logprobs"][0]["logprob"] == -0.5
    assert [t["token"] for t in delta["logprobs"][0]["top_logprobs"]] == ["Hi", "Ho"]
    (done,) = [e for e in events if e["type"] == "response.output_text.done"]
    assert done["logprobs"] == delta["logprobs"]


class ScriptedCalls:
    """A parser that turns the tokens into one function call (the tool parser's shape)."""

    made_calls = True

    def feed(self, token: TokenEvent) -> list[OutputEvent]:
        if token.index == 0:
            return [CallStart(0, "get_weather"), ArgumentsDelta(0, token.text)]
        return [ArgumentsDelta(0, token.text)]

    def end(self) -> list[OutputEvent]:
        return []

    def call_id(self, index: int) -> str:
        return f"call_{index + 1}"


def test_a_function_call_streams_its_arguments_then_is_done_whole() -> None:
    finish = FinishEvent("r", FinishReason.STOP, prompt_tokens=1, completion_tokens=2)
    events = whole(encoder(ScriptedCalls()), [*tokens('{"city": ', '"Paris"}'), finish])

    types = [e["type"] for e in events]
    assert types[2:] == [
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    for event in events:
        EVENTS.validate_python(event)
    item = events[-1]["response"]["output"][0]
    assert (item["type"], item["name"], json.loads(item["arguments"])) == (
        "function_call", "get_weather", {"city": "Paris"})


def test_a_resumed_reader_gets_only_the_events_after_its_number() -> None:
    items = [*tokens("a", "b", "c"), FinishEvent("r", FinishReason.EOS, 1, 3)]
    everything = whole(encoder(), items)
    rest = whole(encoder(skip_through=4), items)

    assert rest == everything[5:]


def test_an_error_after_the_first_byte_is_an_error_event_the_sdk_raises() -> None:
    enc = encoder()
    data = enc.opening() + enc.encode([*tokens("a"), StreamError(ErrorType.SLOW_CLIENT, "x")])
    events = decode(data)

    assert events[-1] == {"type": "error", "sequence_number": len(events) - 1,
                          "code": "slow_client", "message": "x", "param": None}
    EVENTS.validate_python(events[-1])


def test_keepalives_between_events_dispatch_nothing_to_the_sdk_s_decoder() -> None:
    enc = encoder()
    finish = FinishEvent("r", FinishReason.EOS, prompt_tokens=1, completion_tokens=1)
    quiet = encoder()
    plain = quiet.opening() + quiet.encode([*tokens("a"), finish])
    data = (enc.opening() + enc.keepalive() + enc.encode(tokens("a")) + enc.keepalive()
            + enc.encode([finish]))

    assert decode(data) == decode(plain)
