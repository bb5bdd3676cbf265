"""What clients of the embedded SmolLM2 ran into (issue 45), through the official SDKs
over real HTTP: a named tool is called once; a JSON integer cannot run away; a request
that names no limit ends by itself, and a long limit is served.

Run alone with ``pytest -m smoke``; the model is small, so the tests check what the
server guarantees (one call, a parsed object, a finish reason), not the model's wisdom.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anthropic
import openai
import pytest
import trio

from engine.model import LoadedModel
from tests.http_server import RunningServer, StartServer
from tests.tool_servers import BIG_BODIES, CLIENT_TIMEOUT_S, tool_engine

pytestmark = pytest.mark.smoke
MODEL = "smollm2"
# Asked of two cities, the model calls the tool for each (two calls, greedy) unless the
# answer's schema allows one.
QUESTION = [{"role": "user", "content": "Is it raining in Tokyo? And in London?"}]
PARAMETERS = {"type": "object", "required": ["location"],
              "properties": {"location": {"type": "string"},
                             "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}


WEATHER_TOOL: Any = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a given location",
    "parameters": PARAMETERS}}


@pytest.fixture
async def smollm2_server(start_server: StartServer) -> RunningServer:
    from engine.model import load_model

    loaded: LoadedModel = await trio.to_thread.run_sync(load_model, "smollm2", "cpu")
    return await start_server(make_engine=tool_engine(loaded), model_name=MODEL,
                              max_body_bytes=BIG_BODIES)


@pytest.fixture
async def client(smollm2_server: RunningServer) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=f"{smollm2_server.base_url}/v1", api_key="unused",
                                  max_retries=0, timeout=CLIENT_TIMEOUT_S) as sdk:
        yield sdk


async def test_a_named_function_is_called_exactly_once(client: openai.AsyncOpenAI) -> None:
    """``parallel_tool_calls`` left out (true): a named choice still gives one call, as
    OpenAI and vLLM do (it streamed two identical calls before)."""
    indices, names, finish = [], [], None
    stream = await client.chat.completions.create(
        model=MODEL, max_tokens=200, temperature=0, tools=[WEATHER_TOOL], messages=QUESTION,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=True)
    async for chunk in stream:
        for delta in chunk.choices[0].delta.tool_calls or []:
            indices.append(delta.index)
            if delta.function is not None and delta.function.name:
                names.append(delta.function.name)
        finish = chunk.choices[0].finish_reason or finish

    assert (sorted(set(indices)), names, finish) == ([0], ["get_weather"], "tool_calls")


async def test_a_named_anthropic_tool_is_used_exactly_once(
    smollm2_server: RunningServer,
) -> None:
    async with anthropic.AsyncAnthropic(base_url=smollm2_server.base_url, api_key="unused",
                                        max_retries=0, timeout=CLIENT_TIMEOUT_S) as sdk:
        message = await sdk.messages.create(
            model=MODEL, max_tokens=200, extra_body={"temperature": 0}, messages=QUESTION,
            tools=[{"name": "get_weather", "input_schema": PARAMETERS,
                    "description": "Get the current weather in a given location"}],
            tool_choice={"type": "tool", "name": "get_weather"})

    assert [block.type for block in message.content] == ["tool_use"], message.content
    [block] = message.content
    assert (message.stop_reason, block.type) == ("tool_use", "tool_use")
    assert block.name == "get_weather" and "location" in block.input
