"""New tokens up to the model's context, on every route, through the official SDKs (issue 45).

A request that names no limit gets what the context leaves after its prompt (it was cut
at 64 tokens); one that names up to the context is served, to the context's end at most
(anything over 1,024 was refused); one over the context is refused before the stream
with the route's envelope, naming its field and the numbers; the operator's settings
cap both lower. The tiny random model's context is
512 positions (the test cache holds 1,024), and ``ignore_eos`` lets its answer run to
the end of its budget, so the budget itself is what the tests read.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import anthropic
import httpx
import openai
import pytest

from engine.model import LoadedModel
from tests.http_server import RunningServer, StartServer
from tests.tool_servers import CLIENT_TIMEOUT_S, MODEL, start_tool_server

CONTEXT = 512  # the tiny GPT-2's positions
UNCAPPED = {"max_new_tokens_limit": None, "default_max_new_tokens": None}
HELLO = [{"role": "user", "content": "Hello there"}]
RUN_ON: dict[str, Any] = {"ignore_eos": True}


@pytest.fixture
async def server(start_server: StartServer,
                 tiny_model: Callable[[str], LoadedModel]) -> RunningServer:
    return await start_tool_server(start_server, tiny_model("tiny-gpt2"), **UNCAPPED)


async def sdk_of(server: RunningServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused",
                              max_retries=0, timeout=CLIENT_TIMEOUT_S)


@pytest.fixture
async def client(server: RunningServer) -> AsyncIterator[openai.AsyncOpenAI]:
    async with await sdk_of(server) as sdk:
        yield sdk


async def test_no_max_tokens_gets_what_the_context_leaves(client: openai.AsyncOpenAI) -> None:
    completion = await client.chat.completions.create(
        model=MODEL, messages=HELLO, temperature=0, extra_body=RUN_ON)

    usage = completion.usage
    assert usage is not None and completion.choices[0].finish_reason == "length"
    assert usage.prompt_tokens + usage.completion_tokens == CONTEXT


async def test_a_limit_up_to_the_context_is_served_to_the_contexts_end(
    client: openai.AsyncOpenAI,
) -> None:
    within = await client.chat.completions.create(
        model=MODEL, messages=HELLO, temperature=0, max_tokens=CONTEXT - 100, extra_body=RUN_ON)
    whole = await client.chat.completions.create(
        model=MODEL, messages=HELLO, temperature=0, max_tokens=CONTEXT, extra_body=RUN_ON)

    assert within.usage is not None and within.usage.completion_tokens == CONTEXT - 100
    assert whole.usage is not None and whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens + whole.usage.completion_tokens == CONTEXT


async def test_openai_refuses_a_limit_over_the_context_naming_field_and_numbers(
    client: openai.AsyncOpenAI,
) -> None:
    with pytest.raises(openai.BadRequestError) as chat:
        await client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4096)
    with pytest.raises(openai.BadRequestError) as newer:
        await client.chat.completions.create(model=MODEL, messages=HELLO,
                                             max_completion_tokens=CONTEXT + 1)
    with pytest.raises(openai.BadRequestError) as completions:
        await client.completions.create(model=MODEL, prompt="Hello", max_tokens=32_000)

    for raised, field, asked in ((chat, "max_tokens", 4096),
                                 (newer, "max_completion_tokens", CONTEXT + 1),
                                 (completions, "max_tokens", 32_000)):
        error = raised.value
        assert (error.status_code, error.param) == (400, field)
        assert f"{field} is {asked}" in error.message and f"context of {CONTEXT}" in error.message


async def test_anthropic_refuses_a_limit_over_the_context(server: RunningServer) -> None:
    async with anthropic.AsyncAnthropic(base_url=server.base_url, api_key="unused",
                                        max_retries=0, timeout=CLIENT_TIMEOUT_S) as sdk:
        served = await sdk.messages.create(model=MODEL, max_tokens=CONTEXT - 100, messages=HELLO,
                                           extra_body={"temperature": 0})
        with pytest.raises(anthropic.BadRequestError) as raised:
            await sdk.messages.create(model=MODEL, max_tokens=8192, messages=HELLO)

    assert served.stop_reason in ("end_turn", "max_tokens")
    assert raised.value.status_code == 400
    assert "max_tokens is 8192" in str(raised.value) and f"of {CONTEXT}" in str(raised.value)


async def test_responses_and_native_refuse_with_their_fields(
    client: openai.AsyncOpenAI, server: RunningServer,
) -> None:
    with pytest.raises(openai.BadRequestError) as responses:
        await client.responses.create(model=MODEL, input="Hello", max_output_tokens=4096)
    async with httpx.AsyncClient(base_url=server.base_url, trust_env=False) as http:
        native = await http.post("/v1/generate", json={"prompt": "Hello",
                                                       "max_new_tokens": 4096})

    assert (responses.value.status_code, responses.value.param) == (400, "max_output_tokens")
    assert native.status_code == 422
    error = native.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request", "max_new_tokens")
    assert "max_new_tokens is 4096" in error["message"]


async def test_a_prompt_that_fills_the_context_is_refused(client: openai.AsyncOpenAI) -> None:
    long_prompt = " ".join(f"w{n}" for n in range(CONTEXT))  # more tokens than positions
    with pytest.raises(openai.BadRequestError) as raised:
        await client.completions.create(model=MODEL, prompt=long_prompt)
    with pytest.raises(openai.BadRequestError) as chat:
        await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": long_prompt}])

    assert raised.value.code == chat.value.code == "prompt_too_long"


async def test_the_operators_settings_cap_both(
    start_server: StartServer, tiny_model: Callable[[str], LoadedModel],
) -> None:
    capped = await start_tool_server(start_server, tiny_model("tiny-gpt2"),
                                     max_new_tokens_limit=100, default_max_new_tokens=20)
    async with await sdk_of(capped) as sdk:
        default = await sdk.chat.completions.create(model=MODEL, messages=HELLO,
                                                    temperature=0, extra_body=RUN_ON)
        with pytest.raises(openai.BadRequestError) as raised:
            await sdk.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=101)

    assert default.usage is not None and default.usage.completion_tokens == 20
    assert raised.value.param == "max_tokens" and "at most 100" in raised.value.message
