"""Structured output and tool calls on the OpenAI routes, as the official SDK uses them.

Every test drives ``openai.AsyncOpenAI`` (or raw httpx, for the bytes) against a real
hypercorn on loopback with the tiny random model and a ChatML template. A random model
under a constraint still writes conforming output, so the tests check conformance (valid
JSON of the schema, a call of an offered function whose arguments validate), never
wisdom; the schemas bound every value (``enum``, ranges) so that an answer ends within
its token budget. The embedded model's turn is in ``test_tools_smollm2.py``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

import httpx
import openai
import pydantic
import pytest

from engine.model import LoadedModel
from tests.http_server import RunningServer, StartServer
from tests.tool_servers import (
    CLIENT_TIMEOUT_S,
    MODEL,
    Wx,
    constrain_once,
    start_tool_server,
)

QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


class Weather(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    city: Literal["Paris", "Rome", "Oslo"]
    days: int = pydantic.Field(ge=1, le=7)


class Sky(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    sky: Literal["clear", "cloudy", "rain"]
    celsius: int = pydantic.Field(ge=-40, le=50)


WX_TOOL = openai.pydantic_function_tool(Wx, name="wx")
TOOL_MODELS: dict[str, type[pydantic.BaseModel]] = {"wx": Wx}


def small_tool(name: str, values: list[int]) -> dict[str, Any]:
    """A tool whose one argument is one of ``values``: few tokens (see Wx)."""
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {"x": {"enum": values}}, "required": ["x"],
        "additionalProperties": False}}}


@pytest.fixture(scope="module", autouse=True)
def constrained_once(tiny_model: Callable[[str], LoadedModel]) -> None:
    constrain_once(tiny_model("tiny-gpt2"))


@pytest.fixture
async def tool_server(start_server: StartServer,
                      tiny_model: Callable[[str], LoadedModel]) -> RunningServer:
    return await start_tool_server(start_server, tiny_model("tiny-gpt2"))


@pytest.fixture
async def client(tool_server: RunningServer) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=f"{tool_server.base_url}/v1", api_key="unused",
                                  max_retries=0, timeout=CLIENT_TIMEOUT_S) as sdk:
        yield sdk


# -- response_format --------------------------------------------------------------------


async def test_parse_returns_the_pydantic_object(client: openai.AsyncOpenAI) -> None:
    completion = await client.chat.completions.parse(
        model=MODEL, messages=QUESTION, response_format=Sky, max_tokens=40, temperature=0)

    message = completion.choices[0].message
    assert isinstance(message.parsed, Sky)
    assert Sky.model_validate_json(message.content or "") == message.parsed
    assert completion.choices[0].finish_reason == "stop"


async def test_a_seeded_sampled_json_schema_answer_validates(
    client: openai.AsyncOpenAI,
) -> None:
    schema = {"type": "json_schema", "json_schema": {
        "name": "weather", "schema": Weather.model_json_schema(), "strict": True}}

    texts = [(await client.chat.completions.create(
        model=MODEL, messages=QUESTION, response_format=schema,  # type: ignore[arg-type]
        max_tokens=40, temperature=1.0, seed=seed)).choices[0].message.content or ""
        for seed in (1, 2, 3)]

    assert [Weather.model_validate_json(text) for text in texts]


async def test_completions_take_a_response_format(client: openai.AsyncOpenAI) -> None:
    answer = await client.completions.create(
        model=MODEL, prompt="The sky today:", max_tokens=40, temperature=0,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {
            "name": "sky", "schema": Sky.model_json_schema()}}})

    assert Sky.model_validate_json(answer.choices[0].text)


# -- tools --------------------------------------------------------------------------------


async def test_the_stream_helper_yields_argument_deltas_that_parse(
    client: openai.AsyncOpenAI,
) -> None:
    fragments: list[str] = []
    names: list[str] = []
    async with client.chat.completions.stream(
        model=MODEL, messages=QUESTION, tools=[WX_TOOL], parallel_tool_calls=False,
        tool_choice="required", max_tokens=80, temperature=0,
    ) as stream:
        async for event in stream:
            if event.type == "tool_calls.function.arguments.delta":
                fragments.append(event.arguments_delta)
                names.append(event.name)
        final = await stream.get_final_completion()

    choice = final.choices[0]
    calls = choice.message.tool_calls or []
    assert choice.finish_reason == "tool_calls"
    assert len(calls) >= 1 and len(fragments) > 1  # arguments came in fragments
    assert "".join(fragments) == "".join(c.function.arguments for c in calls)
    for call in calls:
        model = TOOL_MODELS[call.function.name]
        assert isinstance(call.function.parsed_arguments, model)
        assert call.id.startswith("call_") and call.type == "function"
    assert set(names) <= set(TOOL_MODELS)


async def test_a_named_function_is_the_one_called_once_without_parallel_calls(
    client: openai.AsyncOpenAI,
) -> None:
    completion = await client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=60, parallel_tool_calls=False,
        tools=[small_tool("a", [1, 2]), small_tool("b", [3, 4])],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "b"}}, temperature=0)

    choice = completion.choices[0]
    calls = choice.message.tool_calls or []
    assert (choice.finish_reason, choice.message.content) == ("tool_calls", None)
    assert [c.function.name for c in calls] == ["b"]
    assert json.loads(calls[0].function.arguments)["x"] in (3, 4)


async def test_a_two_turn_round_trip(client: openai.AsyncOpenAI) -> None:
    messages: list[Any] = list(QUESTION)
    first = await client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WX_TOOL], tool_choice="required",
        max_tokens=60, temperature=0)
    message = first.choices[0].message
    assert message.tool_calls
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls:
        messages.append({"role": "tool", "tool_call_id": call.id,
                         "content": json.dumps({"forecast": "sunny"})})

    second = await client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WX_TOOL], tool_choice="none",
        max_tokens=8, temperature=0)

    answer = second.choices[0]
    assert answer.message.tool_calls is None
    assert isinstance(answer.message.content, str) and answer.message.content


async def test_auto_answers_text_as_content_or_a_valid_call(
    client: openai.AsyncOpenAI,
) -> None:
    for seed in range(4):
        completion = await client.chat.completions.create(
            model=MODEL, messages=QUESTION, tools=[WX_TOOL], tool_choice="auto",
            max_tokens=24, temperature=1.0, seed=seed)
        choice = completion.choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason in ("tool_calls", "length")
        else:
            assert choice.message.content is not None
            assert '"response"' not in choice.message.content[:12]


async def test_the_raw_stream_of_a_tool_call(tool_server: RunningServer) -> None:
    body = {"model": MODEL, "messages": QUESTION, "stream": True, "max_tokens": 80,
            "temperature": 0, "tools": [WX_TOOL], "tool_choice": "required",
            "parallel_tool_calls": False}
    async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S) as http:
        response = await http.post(f"{tool_server.base_url}/v1/chat/completions", json=body)

    lines = [line for line in response.content.split(b"\n") if line]
    assert all(line.startswith(b"data: ") for line in lines)
    assert lines[-1] == b"data: [DONE]"
    deltas = [json.loads(line[6:])["choices"][0] for line in lines[:-1]]
    assert deltas[0]["delta"] == {"role": "assistant", "content": ""}
    first_call = deltas[1]["delta"]["tool_calls"][0]
    assert first_call == {"index": 0, "id": first_call["id"], "type": "function",
                          "function": {"name": "wx", "arguments": ""}}
    fragments = [d["delta"]["tool_calls"][0] for d in deltas[2:-1]]
    assert fragments and all(set(f) == {"index", "function"} for f in fragments)
    assert deltas[-1]["finish_reason"] == "tool_calls" and deltas[-1]["delta"] == {}
    arguments = "".join(f["function"]["arguments"] for f in fragments if f["index"] == 0)
    assert Wx.model_validate_json(arguments)


# -- refusals -----------------------------------------------------------------------------


@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": [WX_TOOL], "tool_choice": {"type": "function",
                                               "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]},
     "tools[0].function.name"),
    ({"tools": [small_tool("a", [1]), small_tool("a", [2])]}, "tools"),
    ({"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {
            "a": {"type": "string", "pattern": "(unclosed"}}}}}]}, "tools"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {
            "a": {"type": "string", "pattern": "(unclosed"}}}}}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(9)]},
     "tools"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "description": "x" * 700}}}},
     "response_format"),
])
async def test_bad_tools_and_formats_are_refused_before_the_stream(
    start_server: StartServer, tiny_model: Callable[[str], LoadedModel],
    fields: dict[str, Any], param: str,
) -> None:
    server = await start_tool_server(start_server, tiny_model("tiny-gpt2"), max_tools=8,
                                     max_schema_bytes=512)
    body = {"model": MODEL, "messages": QUESTION, "stream": True, **fields}
    async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S) as http:
        response = await http.post(f"{server.base_url}/v1/chat/completions", json=body)

    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["type"]) == (param, "invalid_request_error")
    assert server.recorder.submitted == []
