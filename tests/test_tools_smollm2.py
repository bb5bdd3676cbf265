"""Structured output and a tool call on the embedded SmolLM2, through the official SDKs.

SmolLM2's chat template knows no tools, so the tools go into its system turn in the
generic format and the answer is constrained to it (``app/schemas/tools.py``). The model
is small: the tests check that what it writes conforms (a parsed object, a call whose
arguments validate), not that it is wise. Run alone with ``pytest -m smoke``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Literal

import anthropic
import openai
import pydantic
import pytest

from engine.model import LoadedModel
from tests.http_server import RunningServer, StartServer
from tests.tool_servers import BIG_BODIES, CLIENT_TIMEOUT_S, tool_engine

pytestmark = pytest.mark.smoke
MODEL = "smollm2"


class Capital(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    country: str = pydantic.Field(max_length=40)
    capital: str = pydantic.Field(max_length=40)


class Weather(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    city: str = pydantic.Field(max_length=40)
    unit: Literal["celsius", "fahrenheit"]


@pytest.fixture
async def smollm2_server(start_server: StartServer,
                         embedded_model: LoadedModel) -> RunningServer:
    loaded = embedded_model
    return await start_server(make_engine=tool_engine(loaded), model_name=MODEL,
                              max_body_bytes=BIG_BODIES)


@pytest.fixture
async def client(smollm2_server: RunningServer) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=f"{smollm2_server.base_url}/v1", api_key="unused",
                                  max_retries=0, timeout=CLIENT_TIMEOUT_S) as sdk:
        yield sdk


async def test_parse_and_a_tool_call_on_smollm2(
    smollm2_server: RunningServer, client: openai.AsyncOpenAI,
) -> None:
    parsed = await client.chat.completions.parse(
        model=MODEL, response_format=Capital, max_tokens=48, temperature=0,
        messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}])
    fragments: list[str] = []
    async with client.chat.completions.stream(
        model=MODEL, max_tokens=48, temperature=0, parallel_tool_calls=False,
        tools=[openai.pydantic_function_tool(Weather, name="get_weather",
                                             description="The weather in a city now.")],
        tool_choice="required",
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
    ) as stream:
        async for event in stream:
            if event.type == "tool_calls.function.arguments.delta":
                fragments.append(event.arguments_delta)
        final = await stream.get_final_completion()

    assert isinstance(parsed.choices[0].message.parsed, Capital)
    [call] = final.choices[0].message.tool_calls or []
    assert final.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "get_weather"
    assert isinstance(call.function.parsed_arguments, Weather)
    assert "".join(fragments) == call.function.arguments


async def test_a_tool_use_on_smollm2(smollm2_server: RunningServer) -> None:
    async with anthropic.AsyncAnthropic(base_url=smollm2_server.base_url, api_key="unused",
                                        max_retries=0, timeout=CLIENT_TIMEOUT_S) as sdk:
        message = await sdk.messages.create(
            model=MODEL, max_tokens=48, extra_body={"temperature": 0},
            tools=[{"name": "get_weather", "description": "The weather in a city now.",
                    "input_schema": Weather.model_json_schema()}],
            tool_choice={"type": "tool", "name": "get_weather"},
            messages=[{"role": "user", "content": "What is the weather in Paris?"}])

    [block] = message.content
    assert message.stop_reason == "tool_use"
    assert block.type == "tool_use" and block.name == "get_weather"
    assert Weather.model_validate(block.input)
