"""Tool use on ``/v1/messages``, as the official ``anthropic`` SDK uses it.

The server and its warm-up are ``test_tools_openai.py``'s (the tiny random model with a
ChatML template; a bounded tool input so an answer ends in budget). The tests check
conformance: a ``tool_use`` block of an offered tool whose input validates, the event
sequence, the refusals before the first byte.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import anthropic
import httpx
import pytest

from engine.model import LoadedModel
from tests.http_clients import parse_sse
from tests.http_server import RunningServer, StartServer
from tests.tool_servers import CLIENT_TIMEOUT_S, MODEL, Wx, constrain_once, start_tool_server

QUESTION: list[Any] = [{"role": "user", "content": "Weather in Paris?"}]
WX = {"name": "wx", "input_schema": Wx.model_json_schema()}
GREEDY = {"temperature": 0}
ONE_CALL = {"type": "any", "disable_parallel_tool_use": True}


def split_events(raw: bytes) -> list[tuple[str | None, dict[str, Any]]]:
    """Each event's name and JSON data, by our SSE parser."""
    return [(event.event, json.loads(event.data)) for event in parse_sse(raw)]


@pytest.fixture(scope="module", autouse=True)
def constrained_once(tiny_model: Callable[[str], LoadedModel]) -> None:
    constrain_once(tiny_model("tiny-gpt2"))


@pytest.fixture
async def tool_server(start_server: StartServer,
                      tiny_model: Callable[[str], LoadedModel]) -> RunningServer:
    return await start_tool_server(start_server, tiny_model("tiny-gpt2"))


@pytest.fixture
async def client(tool_server: RunningServer) -> AsyncIterator[anthropic.AsyncAnthropic]:
    async with anthropic.AsyncAnthropic(base_url=tool_server.base_url, api_key="unused",
                                        max_retries=0, timeout=CLIENT_TIMEOUT_S) as sdk:
        yield sdk


async def test_a_streamed_tool_use_whose_input_parses(client: anthropic.AsyncAnthropic) -> None:
    fragments: list[str] = []
    async with client.messages.stream(model=MODEL, max_tokens=80, messages=QUESTION,
                                      tools=[WX], tool_choice=ONE_CALL,  # type: ignore[list-item]
                                      extra_body=GREEDY) as stream:
        async for event in stream:
            if event.type == "input_json":
                fragments.append(event.partial_json)
        final = await stream.get_final_message()

    assert final.stop_reason == "tool_use"
    [block] = final.content
    assert block.type == "tool_use" and block.name == "wx" and block.id.startswith("toolu_")
    assert len(fragments) > 1 and Wx.model_validate_json("".join(fragments))
    assert Wx.model_validate(block.input)


async def test_a_whole_message_with_a_tool_use_then_a_tool_result_turn(
    client: anthropic.AsyncAnthropic,
) -> None:
    first = await client.messages.create(model=MODEL, max_tokens=80, messages=QUESTION,
                                         tools=[WX], tool_choice=ONE_CALL,  # type: ignore[list-item]
                                         extra_body=GREEDY)
    [call] = first.content
    assert first.stop_reason == "tool_use" and call.type == "tool_use"
    assert Wx.model_validate(call.input)
    turns: list[Any] = [*QUESTION, {"role": "assistant", "content": first.content},
                        {"role": "user", "content": [
                            {"type": "tool_result", "tool_use_id": call.id,
                             "content": [{"type": "text", "text": "sunny, 21 C"}]},
                            {"type": "text", "text": "And so?"}]}]

    counted_without = await client.messages.count_tokens(model=MODEL, messages=QUESTION)
    counted = await client.messages.count_tokens(model=MODEL, messages=turns)
    second = await client.messages.create(model=MODEL, max_tokens=6, messages=turns,
                                          tools=[WX], tool_choice={"type": "none"},
                                          extra_body=GREEDY)

    assert counted.input_tokens > counted_without.input_tokens
    assert second.usage.input_tokens == counted.input_tokens
    assert [b.type for b in second.content] == ["text"]
    assert second.stop_reason == "max_tokens"


async def test_the_raw_event_sequence_of_a_tool_use(tool_server: RunningServer) -> None:
    body = {"model": MODEL, "max_tokens": 80, "messages": QUESTION, "stream": True,
            "tools": [WX], "tool_choice": ONE_CALL, **GREEDY}
    async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S) as http:
        response = await http.post(f"{tool_server.base_url}/v1/messages", json=body)

    events = split_events(response.content)
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    start = events[2][1]
    assert start["content_block"] == {"type": "tool_use", "id": start["content_block"]["id"],
                                      "name": "wx", "input": {}}
    deltas = [data["delta"] for _, data in events[3:-3]]
    assert {d["type"] for d in deltas} == {"input_json_delta"}
    assert Wx.model_validate_json("".join(d["partial_json"] for d in deltas))
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


@pytest.mark.parametrize("fields", [
    {"tools": [WX], "tool_choice": {"type": "tool", "name": "nope"}},
    {"tools": [WX], "tool_choice": {"type": "tool"}},
    {"tool_choice": {"type": "any"}},
    {"tools": [WX, WX]},
    {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
    {"tools": [{"name": "f", "input_schema": {"type": "object", "properties": {
        "a": {"type": "string", "pattern": "(unclosed"}}}}]},
    {"tools": [{"name": f"f{i}", "input_schema": {"type": "object"}} for i in range(9)]},
    {"messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "wx", "input": {}}]}]},
])
async def test_bad_tools_are_refused_before_the_stream(
    start_server: StartServer, tiny_model: Callable[[str], LoadedModel],
    fields: dict[str, Any],
) -> None:
    server = await start_tool_server(start_server, tiny_model("tiny-gpt2"), max_tools=8)
    body = {"model": MODEL, "max_tokens": 8, "messages": QUESTION, "stream": True, **fields}
    async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S) as http:
        response = await http.post(f"{server.base_url}/v1/messages", json=body)

    assert response.status_code == 400, response.text
    assert response.json()["type"] == "error"
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert server.recorder.submitted == []
