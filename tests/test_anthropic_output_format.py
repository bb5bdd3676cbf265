"""Structured output on ``/v1/messages``: ``output_config.format``, as the official SDK sends it.

``client.messages.parse(output_format=SomeModel)`` (and ``messages.stream`` with the same
argument) sends ``output_config: {"format": {"type": "json_schema", "schema": ...}}`` and
parses the answer's text block into the model. Over real HTTP with the tool tests' server
(the tiny random model with a ChatML template, ``tool_servers.py``): a random model under
the constraint still writes a document of the schema, so the tests check conformance.
The SDK moves numeric bounds (``minimum``, ``maximum``) into descriptions before it sends
a schema (Anthropic's structured output takes none) and validates the answer against the
model's own bounds, so ``Forecast``'s integer is unbounded: the engine's JSON bounds
(``engine.json_bounds``: at most 16 digits) are what make it end within budget.
``output_config.effort`` and any other member stay refused, before anything runs.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

import anthropic
import pydantic
import pytest

from engine.model import LoadedModel
from tests.http_server import RunningServer, StartServer
from tests.tool_servers import CLIENT_TIMEOUT_S, MODEL, Wx, constrain_once, start_tool_server

QUESTION: list[Any] = [{"role": "user", "content": "The sky over Paris?"}]
GREEDY = {"temperature": 0}  # through extra_body, as the newest SDK sends it
BUDGET = 64  # tokens: the keys, an enum value and at most 16 digits fit


class Forecast(pydantic.BaseModel):
    sky: Literal["clear", "cloudy", "rain"]
    celsius: int  # unbounded here: see the module docstring


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


async def test_parse_returns_the_pydantic_object(client: anthropic.AsyncAnthropic) -> None:
    message = await client.messages.parse(model=MODEL, max_tokens=BUDGET, messages=QUESTION,
                                          output_format=Forecast, extra_body=GREEDY)

    assert isinstance(message.parsed_output, Forecast)
    assert [block.type for block in message.content] == ["text"]
    assert Forecast.model_validate_json(message.content[0].text) == message.parsed_output
    assert message.stop_reason == "end_turn"


async def test_sampled_answers_are_documents_of_the_schema(
    client: anthropic.AsyncAnthropic,
) -> None:
    messages = [await client.messages.parse(
        model=MODEL, max_tokens=BUDGET, messages=QUESTION, output_format=Forecast,
        extra_body={"temperature": 1.0, "top_k": top_k}) for top_k in (5, 50, 500)]

    assert all(isinstance(m.parsed_output, Forecast) for m in messages)


async def test_a_streamed_answer_parses_as_the_whole_one(
    client: anthropic.AsyncAnthropic,
) -> None:
    whole = await client.messages.parse(model=MODEL, max_tokens=BUDGET, messages=QUESTION,
                                        output_format=Forecast, extra_body=GREEDY)
    async with client.messages.stream(model=MODEL, max_tokens=BUDGET, messages=QUESTION,
                                      output_format=Forecast, extra_body=GREEDY) as stream:
        streamed = await stream.get_final_message()

    assert streamed.parsed_output == whole.parsed_output
    assert isinstance(streamed.parsed_output, Forecast)


async def test_with_tools_the_answer_is_a_call_or_a_document(
    client: anthropic.AsyncAnthropic,
) -> None:
    message = await client.messages.parse(
        model=MODEL, max_tokens=BUDGET, messages=QUESTION, output_format=Forecast,
        tools=[{"name": "wx", "input_schema": Wx.model_json_schema()}], extra_body=GREEDY)

    block = message.content[-1]
    if block.type == "tool_use":
        assert Wx.model_validate(block.input)
        assert message.stop_reason == "tool_use"
    else:
        assert isinstance(message.parsed_output, Forecast)


async def test_count_tokens_counts_the_prompt_alone(client: anthropic.AsyncAnthropic) -> None:
    plain = await client.messages.count_tokens(model=MODEL, messages=QUESTION)
    formatted = await client.messages.count_tokens(model=MODEL, messages=QUESTION,
                                                   output_format=Forecast)

    assert formatted.input_tokens == plain.input_tokens


@pytest.mark.parametrize(("output_config", "named"), [
    ({"effort": "low"}, "output_config.effort:"),
    ({"format": {"type": "text"}}, "output_config.format.type:"),
    ({"format": {"type": "json_schema"}}, "output_config.format.schema:"),
    ({"task_budget": 1000}, "output_config.task_budget:"),
    ({"format": {"type": "json_schema", "schema": {"type": "frobnicate"}}},
     "output_config.format:"),
])
async def test_what_is_not_served_is_a_400_naming_it(
    client: anthropic.AsyncAnthropic, tool_server: RunningServer,
    output_config: dict[str, Any], named: str,
) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        await client.messages.create(model=MODEL, max_tokens=8, messages=QUESTION,
                                     output_config=output_config)  # type: ignore[arg-type]

    assert caught.value.type == "invalid_request_error"
    assert named in str(caught.value.api_message)
    assert tool_server.recorder.submitted == []


async def test_an_empty_config_asks_for_nothing(
    client: anthropic.AsyncAnthropic, tool_server: RunningServer,
) -> None:
    for output_config in ({}, {"effort": None, "format": None}):
        await client.messages.create(model=MODEL, max_tokens=2, messages=QUESTION,
                                     output_config=output_config,  # type: ignore[arg-type]
                                     extra_body=GREEDY)

    assert len(tool_server.recorder.submitted) == 2
