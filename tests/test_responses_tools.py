"""Structured output and function tools on ``/v1/responses``, as the official SDK uses
them, over real HTTP on loopback (tiny random model, ChatML template). A random model
under a constraint still writes conforming output, so the tests check conformance (a
document of the schema, a call of an offered function whose arguments validate), never
wisdom; the schemas bound every value so an answer ends within its token budget.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

import openai
import pydantic
import pytest

from engine.model import LoadedModel
from tests.http_server import RunningServer, StartServer
from tests.tool_servers import CLIENT_TIMEOUT_S, MODEL, Wx, constrain_once, start_tool_server

WX = {"type": "function", **openai.pydantic_function_tool(Wx, name="wx")["function"]}


class Sky(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    sky: Literal["clear", "cloudy", "rain"]
    celsius: int = pydantic.Field(ge=-40, le=50)


@pytest.fixture(scope="module", autouse=True)
def constrained_once(tiny_model: Callable[[str], LoadedModel]) -> None:
    """The mask kernels prepared before the servers start (``tool_servers.py``)."""
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


async def test_parse_returns_the_pydantic_object(client: openai.AsyncOpenAI) -> None:
    parsed = await client.responses.parse(model=MODEL, input="The sky in Paris?",
                                          text_format=Sky, max_output_tokens=40,
                                          temperature=0)

    assert isinstance(parsed.output_parsed, Sky)
    assert Sky.model_validate_json(parsed.output_text) == parsed.output_parsed
    assert parsed.status == "completed"


async def test_json_object_is_one_object(client: openai.AsyncOpenAI) -> None:
    answer = await client.responses.create(model=MODEL, input="A JSON object, please.",
                                           text={"format": {"type": "json_object"}},
                                           max_output_tokens=60, temperature=0)

    if answer.status == "completed":  # an object may take longer than its budget
        assert isinstance(json.loads(answer.output_text), dict)
    else:
        assert answer.output_text.lstrip().startswith("{")


async def test_a_required_call_streams_its_arguments_then_a_round_trip_answers(
    client: openai.AsyncOpenAI,
) -> None:
    events = [e async for e in await client.responses.create(
        model=MODEL, input="Weather in Paris?", tools=[WX], tool_choice="required",
        parallel_tool_calls=False, max_output_tokens=80, temperature=0, stream=True)]

    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    calls = [item for item in final.output if item.type == "function_call"]
    assert final.status == "completed" and calls and calls[0].name == "wx"
    fragments = "".join(e.delta for e in events
                        if e.type == "response.function_call_arguments.delta")
    assert fragments == calls[0].arguments
    Wx.model_validate_json(calls[0].arguments)  # the arguments validate
    assert any(e.type == "response.function_call_arguments.done" for e in events)

    answer = await client.responses.create(
        model=MODEL, previous_response_id=final.id, tools=[WX], tool_choice="none",
        input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                "output": '{"sky": "clear"}'}], max_output_tokens=4, temperature=0)

    assert answer.previous_response_id == final.id
    assert [item.type for item in answer.output] == ["message"]


async def test_a_named_function_is_the_call_made_whole(client: openai.AsyncOpenAI) -> None:
    answer = await client.responses.create(  # one tool: the tiny model's context is 512
        model=MODEL, input="Weather?", tools=[WX],
        tool_choice={"type": "function", "name": "wx"}, parallel_tool_calls=False,
        max_output_tokens=80, temperature=0)

    calls = [item for item in answer.output if item.type == "function_call"]
    assert [c.name for c in calls] == ["wx"]
    Wx.model_validate_json(calls[0].arguments)


class Tiny(pydantic.BaseModel):
    c: Literal["P", "R"]


@pytest.mark.parametrize(("fields", "param"), [
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [WX]}, None),
    ({"tool_choice": "required"}, None),
    ({"tools": [WX, WX]}, None),
    ({"text": {"format": {"type": "json_schema", "name": "s",
                          "schema": {"type": "object", "properties": {
                              "a": {"type": "string", "pattern": "(?<=x)y"}}}}}},
     "text.format"),
])
async def test_bad_tools_and_formats_are_refused_before_the_stream(
    client: openai.AsyncOpenAI, tool_server: RunningServer, fields: dict[str, Any],
    param: str | None,
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await client.responses.create(model=MODEL, input="Hi", stream=True, **fields)

    if param is not None:
        assert caught.value.param == param
    assert tool_server.recorder.submitted == []
