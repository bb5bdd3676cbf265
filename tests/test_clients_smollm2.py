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
import pydantic
import pytest
import trio

from engine.model import LoadedModel
from tests.http_server import RunningServer, StartServer
from tests.tool_servers import BIG_BODIES, CLIENT_TIMEOUT_S, tool_engine

pytestmark = pytest.mark.smoke
MODEL = "smollm2"
CONTEXT = 8192  # SmolLM2-135M's positions
# Asked of two cities, the model calls the tool for each (two calls, greedy) unless the
# answer's schema allows one.
QUESTION = [{"role": "user", "content": "Is it raining in Tokyo? And in London?"}]
PARAMETERS = {"type": "object", "required": ["location"],
              "properties": {"location": {"type": "string"},
                             "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}


CITIES = ["Paris", "Tokyo", "Lagos", "Lima", "Oslo", "Mumbai", "Cairo", "Toronto"]


class City(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    name: str
    country: str
    population: int


# Greedy, SmolLM2 answers this in more than 64 tokens and ends by itself.
LONG_ANSWER = "Why is the sky blue?"
WEATHER_TOOL: Any = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a given location",
    "parameters": PARAMETERS}}


@pytest.fixture
async def smollm2_server(start_server: StartServer,
                         embedded_model: LoadedModel) -> RunningServer:
    loaded = embedded_model
    # The service's defaults for new tokens (none: the context), and a cache that holds
    # SmolLM2's whole context of 8,192 positions (the tests' 64 blocks hold 1,024).
    return await start_server(make_engine=tool_engine(loaded), model_name=MODEL,
                              max_body_bytes=BIG_BODIES, cache_blocks=CONTEXT // 16,
                              max_new_tokens_limit=None, default_max_new_tokens=None)


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


async def test_parse_of_eight_cities_gives_eight_city_objects(
    client: openai.AsyncOpenAI,
) -> None:
    """A population as a schema ``integer``: SmolLM2 wrote digits until ``max_tokens``
    (7 of these 8 were LengthFinishReasonError at 64 tokens); its digits are bounded now
    (``engine/json_bounds.py``), so every answer ends and parses. Asked at once: the
    server batches them."""
    parsed: dict[str, object] = {}

    async def ask(city: str) -> None:
        completion = await client.chat.completions.parse(
            model=MODEL, response_format=City, max_tokens=64, temperature=0,
            messages=[{"role": "user", "content": f"What is the population of {city}? "
                                                  "Answer in JSON."}])
        parsed[city] = completion.choices[0].message.parsed

    async with trio.open_nursery() as nursery:
        for city in CITIES:
            nursery.start_soon(ask, city)

    assert all(isinstance(value, City) for value in parsed.values()), parsed
    assert len(parsed) == len(CITIES)


async def test_a_chat_without_max_tokens_ends_by_itself(client: openai.AsyncOpenAI) -> None:
    """No ``max_tokens``: what the context leaves (it was 64, and the answer was cut)."""
    completion = await client.chat.completions.create(
        model=MODEL, temperature=0, messages=[{"role": "user", "content": LONG_ANSWER}])

    assert completion.usage is not None and completion.usage.completion_tokens > 64
    assert completion.choices[0].finish_reason == "stop"


async def test_max_tokens_of_the_whole_context_is_served(
    client: openai.AsyncOpenAI, smollm2_server: RunningServer,
) -> None:
    """8,192, SmolLM2's context, with a short prompt: served (it was refused over 1,024),
    on the OpenAI and Anthropic routes; over the context: a 400 naming the numbers."""
    completion = await client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=CONTEXT,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    async with anthropic.AsyncAnthropic(base_url=smollm2_server.base_url, api_key="unused",
                                        max_retries=0, timeout=CLIENT_TIMEOUT_S) as sdk:
        message = await sdk.messages.create(
            model=MODEL, max_tokens=CONTEXT, extra_body={"temperature": 0},
            messages=[{"role": "user", "content": "What is the capital of France?"}])
        with pytest.raises(anthropic.BadRequestError) as raised:
            await sdk.messages.create(model=MODEL, max_tokens=32_000, messages=QUESTION)

    assert completion.choices[0].finish_reason == "stop"
    assert message.stop_reason == "end_turn"
    assert "max_tokens is 32000, over the model's context of 8192" in str(raised.value)


async def test_a_named_responses_function_is_called_exactly_once(
    client: openai.AsyncOpenAI,
) -> None:
    """The Responses API shares the tool format (``app/schemas/tools.py``)."""
    response = await client.responses.create(
        model=MODEL, input=QUESTION[0]["content"], max_output_tokens=200, temperature=0,
        tools=[{"type": "function", "name": "get_weather", "parameters": PARAMETERS,
                "description": "Get the current weather in a given location"}],
        tool_choice={"type": "function", "name": "get_weather"})

    calls = [item for item in response.output if item.type == "function_call"]
    assert [call.name for call in calls] == ["get_weather"], response.output
