"""Issue 48's request side on every API: ``priority`` and ``service_tier`` on the OpenAI
chat and completions, Anthropic Messages and Responses routes, mapped onto bands
(``app/priority_bands.py``); a key's ceiling lowers an over-reaching request instead
of refusing it; the gateway's objective header; the answer's ``service_tier``; and the
refusals naming the field. Each over real HTTP with the official ``openai`` and
``anthropic`` SDKs, on the tiny model with a ChatML template (``serve``). The band a
request was served in is read from the engine's per-band statistics.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import anthropic
import httpx
import openai
import pytest

from app.priority_bands import (
    DEFAULT_BAND,
    FLEX_BAND,
    HIGHEST_BAND,
    LOWEST_BAND,
    OBJECTIVE_HEADER,
)
from app.settings import Settings, SettingsError
from engine.model import LoadedModel
from tests.http_server import SETTLE_TIMEOUT_S, RunningServer, StartServer
from tests.test_responses_sdk import MODEL, serve
from tests.test_scope_http import open_feed

KEY_FAST = "fast-lane-" + "f" * 32  # its ceiling: CEILING
KEY_PLAIN = "plain-key-" + "p" * 32  # no ceiling of its own: the server's, the default
CEILING = -3
QUESTION = [{"role": "user", "content": "The capital of France is"}]
OBJECTIVES = {"critical": -2, "batch": 8}


@pytest.fixture
async def clients() -> AsyncIterator[Callable[..., Any]]:
    """``clients(server, kind, key=...)``: an ``openai`` or ``anthropic`` async client
    of ``server`` with that key, no retries; closed at the end."""
    made: list[Any] = []

    def make(server: RunningServer, kind: str = "openai", key: str = "unused",
             **options: Any) -> Any:
        if kind == "openai":
            client: Any = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=key,
                                             max_retries=0, timeout=SETTLE_TIMEOUT_S,
                                             **options)
        else:
            client = anthropic.AsyncAnthropic(base_url=server.base_url, api_key=key,
                                              max_retries=0, timeout=SETTLE_TIMEOUT_S,
                                              **options)
        made.append(client)
        return client

    yield make
    for client in made:
        await client.close()


@pytest.fixture
async def chat_server(start_server: StartServer,
                      tiny_model: Callable[[str], LoadedModel]) -> RunningServer:
    return await serve(start_server, tiny_model, priority_ceiling=-5,
                       inference_objectives=OBJECTIVES)


@pytest.fixture
async def keyed_server(start_server: StartServer,
                       tiny_model: Callable[[str], LoadedModel]) -> RunningServer:
    return await serve(start_server, tiny_model,
                       api_keys=[{"name": "fast", "key": KEY_FAST},
                                 {"name": "plain", "key": KEY_PLAIN}],
                       priority_ceilings={"fast": CEILING})


def bands(server: RunningServer) -> set[int]:
    """The bands the engine has admitted requests in."""
    return {band for band, _ in server.recorder.statistics().wait_ms_by_band}


# -- the mapping onto bands, and the tier the answer names ------------------------------


@pytest.mark.parametrize(("tier", "band", "served"), [
    ("flex", FLEX_BAND, "flex"),
    ("default", DEFAULT_BAND, "default"),
    ("auto", DEFAULT_BAND, "default"),
    ("scale", DEFAULT_BAND, "default"),  # no capacity reserved: served as default
    ("priority", -5, "priority"),  # the highest band allowed: the server's ceiling
])
async def test_a_chat_service_tier_is_its_band_and_the_answer_names_the_tier(
    chat_server: RunningServer, clients: Any, tier: str, band: int, served: str
) -> None:
    client = clients(chat_server)

    answer = await client.chat.completions.create(model=MODEL, messages=QUESTION,
                                                  max_tokens=2, service_tier=tier)

    assert answer.service_tier == served
    assert bands(chat_server) == {band}


async def test_every_streamed_chunk_names_the_tier(chat_server: RunningServer,
                                                  clients: Any) -> None:
    client = clients(chat_server)

    stream = await client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=3, stream=True,
        stream_options={"include_usage": True}, extra_body={"priority": 2})
    tiers = [chunk.service_tier async for chunk in stream]

    assert tiers and set(tiers) == {"flex"}
    assert bands(chat_server) == {2}


async def test_a_completion_takes_priority_and_service_tier(chat_server: RunningServer,
                                                            clients: Any) -> None:
    client = clients(chat_server)

    low = await client.completions.create(model=MODEL, prompt="Paris is", max_tokens=2,
                                          extra_body={"priority": 7})
    high = await client.completions.create(model=MODEL, prompt="Paris is", max_tokens=2,
                                           extra_body={"service_tier": "priority"})

    assert (low.model_extra or {})["service_tier"] == "flex"
    assert (high.model_extra or {})["service_tier"] == "priority"
    assert bands(chat_server) == {7, -5}


async def test_priority_wins_over_service_tier(chat_server: RunningServer,
                                               clients: Any) -> None:
    client = clients(chat_server)

    answer = await client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=2, service_tier="flex",
        extra_body={"priority": -1})

    assert answer.service_tier == "priority"
    assert bands(chat_server) == {-1}


async def test_a_response_names_its_tier_created_and_done(chat_server: RunningServer,
                                                          clients: Any) -> None:
    client = clients(chat_server)

    whole = await client.responses.create(model=MODEL, input="Paris is",
                                          max_output_tokens=2, service_tier="flex")
    stream = await client.responses.create(model=MODEL, input="Paris is",
                                           max_output_tokens=2, stream=True,
                                           extra_body={"priority": -4})
    events = [event async for event in stream]

    assert whole.service_tier == "flex"
    assert (await client.responses.retrieve(whole.id)).service_tier == "flex"
    created, last = events[0], events[-1]
    assert created.type == "response.created" and created.response.service_tier == "priority"
    assert last.response.service_tier == "priority"
    assert bands(chat_server) == {FLEX_BAND, -4}


async def test_a_message_says_its_tier_in_its_usage(chat_server: RunningServer,
                                                    clients: Any) -> None:
    client = clients(chat_server, "anthropic")

    standard = await client.messages.create(model=MODEL, max_tokens=2, messages=QUESTION,
                                            service_tier="standard_only")
    low = await client.messages.create(model=MODEL, max_tokens=2, messages=QUESTION,
                                       extra_body={"priority": 6})
    async with client.messages.stream(model=MODEL, max_tokens=2, messages=QUESTION,
                                      extra_body={"priority": -2}) as stream:
        high = await stream.get_final_message()

    assert standard.usage.service_tier == "standard"
    assert low.usage.service_tier == "batch"
    assert high.usage.service_tier == "priority"
    assert bands(chat_server) == {DEFAULT_BAND, 6, -2}


# -- key ceilings and the gateway's objective --------------------------------------------


async def test_a_request_above_its_keys_ceiling_is_served_at_the_ceiling(
    keyed_server: RunningServer, clients: Any
) -> None:
    fast = clients(keyed_server, key=KEY_FAST)
    plain = clients(keyed_server, key=KEY_PLAIN)

    top = await fast.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2,
                                             service_tier="priority")
    over = await fast.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2,
                                              extra_body={"priority": HIGHEST_BAND})
    assert top.service_tier == over.service_tier == "priority"
    assert bands(keyed_server) == {CEILING}

    lowered = await plain.chat.completions.create(model=MODEL, messages=QUESTION,
                                                  max_tokens=2, service_tier="priority")
    assert lowered.service_tier == "default"  # not refused: served at its ceiling, 0
    assert bands(keyed_server) == {CEILING, DEFAULT_BAND}


async def test_a_key_may_ask_below_its_ceiling(keyed_server: RunningServer,
                                              clients: Any) -> None:
    client = clients(keyed_server, "anthropic", key=KEY_FAST)

    message = await client.messages.create(model=MODEL, max_tokens=2, messages=QUESTION,
                                           extra_body={"priority": CEILING + 2})

    assert message.usage.service_tier == "priority"
    assert bands(keyed_server) == {CEILING + 2}


@pytest.mark.parametrize(("objective", "band"), [
    ("critical", OBJECTIVES["critical"]),
    ("batch", OBJECTIVES["batch"]),
    ("unheard-of", DEFAULT_BAND),  # an objective the operator did not name
])
async def test_the_gateways_objective_header_picks_the_band(
    chat_server: RunningServer, clients: Any, objective: str, band: int
) -> None:
    client = clients(chat_server, default_headers={OBJECTIVE_HEADER: objective})

    await client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2)

    assert bands(chat_server) == {band}


async def test_the_bodys_own_ask_wins_over_the_objective(chat_server: RunningServer,
                                                         clients: Any) -> None:
    client = clients(chat_server, default_headers={OBJECTIVE_HEADER: "batch"})

    answer = await client.chat.completions.create(model=MODEL, messages=QUESTION,
                                                  max_tokens=2, service_tier="default")

    assert answer.service_tier == "default"
    assert bands(chat_server) == {DEFAULT_BAND}


# -- refusals: 400 naming the field, before anything is admitted --------------------------


@pytest.mark.parametrize(("field", "value"), [
    ("service_tier", "turbo"),
    ("service_tier", "standard_only"),  # Anthropic's, not OpenAI's
    ("priority", HIGHEST_BAND - 1),
    ("priority", LOWEST_BAND + 1),
    ("priority", "1"),
])
async def test_openai_refuses_a_bad_tier_or_priority_naming_it(
    chat_server: RunningServer, clients: Any, field: str, value: Any
) -> None:
    client = clients(chat_server)

    with pytest.raises(openai.BadRequestError) as chat:
        await client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2,
                                             extra_body={field: value})
    with pytest.raises(openai.BadRequestError) as completion:
        await client.completions.create(model=MODEL, prompt="Paris", max_tokens=2,
                                        extra_body={field: value})
    with pytest.raises(openai.BadRequestError) as response:
        await client.responses.create(model=MODEL, input="Paris", max_output_tokens=2,
                                      extra_body={field: value})

    assert chat.value.param == completion.value.param == response.value.param == field
    assert chat_server.recorder.statistics().admitted == 0


@pytest.mark.parametrize(("field", "value"), [
    ("service_tier", "priority"),  # OpenAI's, not Anthropic's
    ("priority", LOWEST_BAND + 1),
])
async def test_anthropic_refuses_a_bad_tier_or_priority_naming_it(
    chat_server: RunningServer, clients: Any, field: str, value: Any
) -> None:
    client = clients(chat_server, "anthropic")

    with pytest.raises(anthropic.BadRequestError) as caught:
        await client.messages.create(model=MODEL, max_tokens=2, messages=QUESTION,
                                     extra_body={field: value})

    assert caught.value.status_code == 400
    assert field in caught.value.message
    assert chat_server.recorder.statistics().admitted == 0


# -- the operator's settings -------------------------------------------------------------


def test_a_ceiling_must_name_a_key_and_every_band_be_in_range() -> None:
    key = [{"name": "ci", "key": KEY_PLAIN}]
    with pytest.raises(SettingsError, match="PRIORITY_CEILINGS names no API key"):
        Settings(api_keys=key, priority_ceilings={"nobody": -1})
    with pytest.raises(SettingsError, match="INFERENCE_OBJECTIVES"):
        Settings.from_env({"STREAMSCOPE_INFERENCE_OBJECTIVES": json.dumps({"x": 11})})
    with pytest.raises(SettingsError, match="PRIORITY_CEILING"):
        Settings.from_env({"STREAMSCOPE_PRIORITY_CEILING": "-11"})
    read = Settings.from_env({"STREAMSCOPE_API_KEYS": json.dumps(key),
                              "STREAMSCOPE_PRIORITY_CEILINGS": '{"ci": -4}',
                              "STREAMSCOPE_INFERENCE_OBJECTIVES": '{"b": 3, "a": -1}'})
    assert dict(read.priority_ceilings) == {"ci": -4}
    assert dict(read.inference_objectives) == {"a": -1, "b": 3}
    assert hash(read) == hash(read.replace())  # still hashable, as every setting is


async def test_the_objective_header_reaches_the_native_route(
    chat_server: RunningServer,
) -> None:
    async with httpx.AsyncClient(base_url=chat_server.base_url,
                                 timeout=SETTLE_TIMEOUT_S) as client:
        response = await client.post("/v1/generate", json={"prompt": "Paris",
                                                           "max_new_tokens": 2},
                                     headers={OBJECTIVE_HEADER: "critical"})
    assert response.status_code == 200
    assert bands(chat_server) == {OBJECTIVES["critical"]}


async def test_the_scope_shows_a_rows_band(chat_server: RunningServer) -> None:
    async with chat_server.client() as client, open_feed(client) as feed:
        answer = await client.post("/v1/generate", json={"prompt": "Paris",
                                                         "max_new_tokens": 2,
                                                         "priority": 4})
        assert answer.status_code == 200
        request_id = answer.headers["X-Request-ID"]
        await feed.until(lambda: bool(feed.rows(request_id)), "the row")
        assert {row["band"] for row in feed.rows(request_id)} == {4}
