"""The same OpenAI request field means the same thing on chat and on Responses.

Over real HTTP with the official ``openai`` SDK, against the tiny model with a ChatML
template (``test_openai_sdk.chat_server``), greedy so that an answer is the same every
time:

* a reasoning effort (chat's ``reasoning_effort``, Responses' ``reasoning``, which
  Codex-style clients send) is accepted and changes nothing where the template has no
  use for it, and is refused naming the field where it reads it;
* prompt-cache hints and ``verbosity`` (chat) / ``text.verbosity`` (Responses) are
  accepted and change nothing; a value outside OpenAI's is a 400 naming the field;
* ``moderation`` is refused on both (a 400 naming it, nothing submitted), and null is
  accepted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import openai
import pytest

from app.settings import Settings
from engine.engine import Engine
from engine.model import LoadedModel
from tests import test_openai_sdk
from tests.http_server import RecordingEngine, RunningServer, StartServer
from tests.test_openai_sdk import CHATML, MODEL, QUESTION, with_chat_template

chat_server = test_openai_sdk.chat_server  # the fixtures: a ChatML tiny model, the SDK client
sdk = test_openai_sdk.sdk

CHAT: dict[str, Any] = {"model": MODEL, "messages": QUESTION, "max_tokens": 6,
                        "temperature": 0}
RESPONSE: dict[str, Any] = {"model": MODEL, "input": QUESTION[-1]["content"],
                            "max_output_tokens": 6, "temperature": 0, "store": False}
MODERATION = {"model": "omni-moderation-latest"}
CACHE_HINTS: dict[str, Any] = {"prompt_cache_options": {"mode": "explicit", "ttl": "30m"},
                               "prompt_cache_retention": "24h"}
# A template that reads reasoning_effort: a request carrying one would be rendered without it.
READS_EFFORT = ("{% if reasoning_effort %}Reasoning: {{ reasoning_effort }}\n{% endif %}"
                + CHATML)


async def chat_text(client: openai.AsyncOpenAI, **fields: Any) -> str | None:
    return (await client.chat.completions.create(**CHAT, **fields)).choices[0].message.content


async def response_text(client: openai.AsyncOpenAI, **fields: Any) -> str:
    return (await client.responses.create(**RESPONSE, **fields)).output_text


async def test_responses_reasoning_changes_nothing_where_the_template_ignores_it(
    chat_server: RunningServer, sdk: Any
) -> None:
    client, _ = sdk(chat_server)

    plain = await response_text(client)
    reasoned = await response_text(client, reasoning={"effort": "high", "summary": "auto"})
    older = await response_text(client, reasoning={"effort": "max",
                                                   "generate_summary": "concise"})

    assert reasoned == older == plain
    assert plain  # an answer, not an empty one compared with another


async def test_reasoning_is_refused_on_both_routes_where_the_template_reads_it(
    start_server: StartServer, tiny_model: Callable[[str], LoadedModel], sdk: Any
) -> None:
    loaded = with_chat_template(tiny_model(MODEL), READS_EFFORT)

    def make_engine(s: Settings) -> RecordingEngine:
        return RecordingEngine(Engine(loaded, max_batch=s.max_batch, num_blocks=s.cache_blocks,
                                      block_size=s.block_size))

    server = await start_server(make_engine=make_engine)
    client, _ = sdk(server)

    with pytest.raises(openai.BadRequestError) as on_responses:
        await client.responses.create(**RESPONSE, reasoning={"effort": "low"})
    with pytest.raises(openai.BadRequestError) as on_chat:
        await client.chat.completions.create(**CHAT, reasoning_effort="low")
    summary_only = await client.responses.create(**RESPONSE, reasoning={"summary": "auto"})

    assert on_responses.value.param == "reasoning.effort"
    assert on_chat.value.param == "reasoning_effort"
    assert server.recorder.submitted == [summary_only.id.removeprefix("resp_")]


@pytest.mark.parametrize(("reasoning", "param"), [
    ({"effort": "extreme"}, "reasoning.effort"),
    ({"mode": "pro"}, "reasoning.mode"),
    ({"budget": 100}, "reasoning.budget"),
])
async def test_a_reasoning_outside_openais_values_is_a_400_naming_it(
    chat_server: RunningServer, sdk: Any, reasoning: dict[str, Any], param: str
) -> None:
    client, _ = sdk(chat_server)

    with pytest.raises(openai.BadRequestError) as caught:
        await client.responses.create(**RESPONSE, reasoning=reasoning)

    assert caught.value.param == param
    assert chat_server.recorder.submitted == []


async def test_cache_hints_and_verbosity_change_nothing_on_either_route(
    chat_server: RunningServer, sdk: Any
) -> None:
    client, _ = sdk(chat_server)

    chat_plain = await chat_text(client)
    chat_hinted = [await chat_text(client, **CACHE_HINTS, verbosity=verbosity)
                   for verbosity in ("low", "high")]
    plain = await response_text(client)
    hinted = [await response_text(client, **CACHE_HINTS, text={"verbosity": verbosity})
              for verbosity in ("low", "high")]

    assert chat_hinted == [chat_plain] * 2
    assert hinted == [plain] * 2


async def test_a_verbosity_outside_openais_values_is_a_400_on_either_route(
    chat_server: RunningServer, sdk: Any
) -> None:
    client, _ = sdk(chat_server)

    with pytest.raises(openai.BadRequestError) as on_chat:
        await client.chat.completions.create(**CHAT, extra_body={"verbosity": "terse"})
    with pytest.raises(openai.BadRequestError) as on_responses:
        await client.responses.create(**RESPONSE, extra_body={"text": {"verbosity": "terse"}})

    assert on_chat.value.param == "verbosity"
    assert on_responses.value.param == "text.verbosity"
    assert chat_server.recorder.submitted == []


async def test_moderation_is_refused_on_both_routes_and_null_is_accepted(
    chat_server: RunningServer, sdk: Any
) -> None:
    client, _ = sdk(chat_server)

    with pytest.raises(openai.BadRequestError) as on_chat:
        await client.chat.completions.create(**CHAT, moderation=MODERATION)
    with pytest.raises(openai.BadRequestError) as on_responses:
        await client.responses.create(**RESPONSE, moderation=MODERATION)  # type: ignore[arg-type]
    refused = list(chat_server.recorder.submitted)
    await client.chat.completions.create(**CHAT, moderation=None)
    await client.responses.create(**RESPONSE, moderation=None)

    assert on_chat.value.param == on_responses.value.param == "moderation"
    assert "does not support" in on_chat.value.message
    assert refused == []
    assert len(chat_server.recorder.submitted) == 2
