"""``/v1/responses`` on the embedded SmolLM2 model, as the openai SDK uses it: the stream
helper read to a ``completed`` response that names Paris, ``parse(text_format=...)``
returning its pydantic object, and a function-tool round trip whose call validates.
Loads the embedded model (a few seconds from its converted copy): ``pytest -m smoke``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Literal

import openai
import pydantic
import pytest

from app.settings import Settings
from engine.engine import Engine
from engine.model import LoadedModel
from tests.http_server import RecordingEngine, RunningServer, StartServer

pytestmark = pytest.mark.smoke

CLIENT_TIMEOUT_S = 300.0  # a safety net: a busy 2-core machine decodes slowly


class City(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    name: Literal["Paris", "Rome", "Berlin", "Madrid"]
    country: Literal["France", "Italy", "Germany", "Spain"]


class Weather(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    city: Literal["Paris", "Rome", "Oslo"]


WEATHER = {"type": "function", **openai.pydantic_function_tool(Weather, name="weather")[
    "function"]}


@pytest.fixture(scope="module")
def smollm2(embedded_model: LoadedModel) -> LoadedModel:
    return embedded_model  # the session's one load (conftest.py)


@pytest.fixture
async def server(start_server: StartServer, smollm2: LoadedModel) -> RunningServer:
    def make_engine(s: Settings) -> RecordingEngine:
        return RecordingEngine(Engine(smollm2, max_batch=s.max_batch,
                                      num_blocks=s.cache_blocks, block_size=s.block_size))

    return await start_server(make_engine=make_engine, model="smollm2", cache_blocks=256,
                              max_body_bytes=64 * 1024)


@pytest.fixture
async def client(server: RunningServer) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused",
                                  max_retries=0, timeout=CLIENT_TIMEOUT_S) as sdk:
        yield sdk


async def test_the_stream_helper_reads_a_completed_answer(client: openai.AsyncOpenAI) -> None:
    async with client.responses.stream(model="smollm2", input="What is the capital of France?",
                                       instructions="Answer in one short sentence.",
                                       max_output_tokens=40, temperature=0) as stream:
        deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
        final = await stream.get_final_response()

    assert final.status == "completed"
    assert final.output_text == "".join(deltas)
    assert "Paris" in final.output_text


async def test_parse_returns_the_pydantic_object(client: openai.AsyncOpenAI) -> None:
    parsed = await client.responses.parse(model="smollm2", input="Which city is the capital "
                                          "of France?", text_format=City,
                                          max_output_tokens=40, temperature=0)

    assert isinstance(parsed.output_parsed, City)
    assert parsed.output_parsed.name == "Paris"


async def test_a_function_tool_round_trip(client: openai.AsyncOpenAI) -> None:
    called = await client.responses.create(
        model="smollm2", input="What is the weather in Paris?", tools=[WEATHER],
        tool_choice="required", parallel_tool_calls=False, max_output_tokens=40,
        temperature=0)
    calls = [item for item in called.output if item.type == "function_call"]
    assert [c.name for c in calls] == ["weather"]
    Weather.model_validate_json(calls[0].arguments)

    answer = await client.responses.create(
        model="smollm2", previous_response_id=called.id, tools=[WEATHER], tool_choice="none",
        input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                "output": "Sunny, 24 degrees."}], max_output_tokens=40, temperature=0)

    assert answer.status in ("completed", "incomplete")
    assert [item.type for item in answer.output] == ["message"] and answer.output_text
