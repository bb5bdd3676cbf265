"""Background responses and disconnects on ``/v1/responses``, with the official ``openai``
SDK over real HTTP on loopback (tiny model, ChatML template): a background response
runs with no client, is read again from a cut with ``starting_after`` (every event
once, the same text), is cancelled idempotently (its blocks come back: the fixture's
checks), and survives its reader's disconnect; a foreground stream's disconnect
cancels it, once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import openai
import pytest
import trio

from engine import FinishReason
from engine.model import LoadedModel
from tests import test_openai_sdk
from tests.http_server import RunningServer, StartServer
from tests.test_responses_sdk import MODEL, serve

sdk = test_openai_sdk.sdk  # the fixture: an AsyncOpenAI client of a server

PACE_S = 0.02  # each engine step waits this long: a stream of 40 tokens takes 0.8 s at least


@pytest.fixture
async def chat_server(start_server: StartServer,
                      tiny_model: Callable[[str], LoadedModel]) -> RunningServer:
    return await serve(start_server, tiny_model)


def request_id(response_id: str) -> str:
    return response_id.removeprefix("resp_")


async def settled(client: openai.AsyncOpenAI, response_id: str) -> Any:
    with trio.fail_after(10):
        while True:
            response = await client.responses.retrieve(response_id)
            if response.status not in ("queued", "in_progress"):
                return response
            await trio.sleep(0.01)


async def test_a_background_response_runs_with_no_client_and_is_stored(
    chat_server: RunningServer, sdk: Any
) -> None:
    client, _ = sdk(chat_server)
    fields: dict[str, Any] = {"model": MODEL, "input": "The capital of France is",
                              "max_output_tokens": 6, "temperature": 0}

    made = await client.responses.create(**fields, background=True)
    final = await settled(client, made.id)
    foreground = await client.responses.create(**fields)

    assert made.status == "queued" and made.background
    assert final.status == "incomplete" and final.output_text == foreground.output_text
    assert final.usage is not None and final.usage.output_tokens == 6


async def test_a_cut_background_stream_resumes_after_its_last_event(
    chat_server: RunningServer, sdk: Any
) -> None:
    client, _ = sdk(chat_server)
    chat_server.recorder.pace(PACE_S)
    first: list[Any] = []

    stream = await client.responses.create(model=MODEL, input="Once upon a time",
                                           max_output_tokens=40, temperature=0,
                                           background=True, stream=True)
    async for event in stream:
        first.append(event)
        if event.type == "response.output_text.delta" and len(first) > 6:
            break
    await stream.close()  # the reader leaves; the response goes on
    response_id = first[0].response.id
    rest = [e async for e in await client.responses.retrieve(
        response_id, stream=True, starting_after=first[-1].sequence_number)]
    again = [e async for e in await client.responses.retrieve(response_id, stream=True)]

    events = first + rest
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.model_dump() for e in again] == [e.model_dump() for e in events]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = await client.responses.retrieve(response_id)
    assert events[-1].type == "response.incomplete" and final.status == "incomplete"
    assert final.output_text == text == events[-1].response.output_text
    finish = await chat_server.wait_finished(request_id(response_id))
    assert finish.reason is FinishReason.LENGTH  # the disconnect cancelled nothing


async def test_cancel_ends_a_background_response_once(
    chat_server: RunningServer, sdk: Any
) -> None:
    client, _ = sdk(chat_server)
    chat_server.recorder.pace(PACE_S)
    made = await client.responses.create(model=MODEL, input="Hi", max_output_tokens=400,
                                         background=True)
    await chat_server.wait_for(
        lambda: len(chat_server.recorder.token_ids_of(request_id(made.id))) > 2,
        "tokens of the background response")

    cancelled = await client.responses.cancel(made.id)
    again = await client.responses.cancel(made.id)
    finish = await chat_server.wait_finished(request_id(made.id))

    assert cancelled.status == again.status == "cancelled"
    assert (await client.responses.retrieve(made.id)).status == "cancelled"
    assert finish.reason is FinishReason.CANCELLED
    assert finish.completion_tokens < 400


async def test_a_foreground_disconnect_cancels_its_stream_once(
    chat_server: RunningServer, sdk: Any
) -> None:
    client, _ = sdk(chat_server)
    chat_server.recorder.pace(PACE_S)

    stream = await client.responses.create(model=MODEL, input="Hi", max_output_tokens=400,
                                           stream=True)
    async for event in stream:
        if event.type == "response.output_text.delta":
            break
    await stream.close()
    response_id = stream.response.headers["x-request-id"]
    finish = await chat_server.wait_finished(response_id)

    assert finish.reason is FinishReason.CANCELLED and finish.completion_tokens < 400
    assert list(chat_server.recorder.cancel_marks) == [response_id]
    stored = await settled(client, "resp_" + response_id)
    assert stored.status == "cancelled"


async def test_only_background_responses_stream_again_or_cancel(
    chat_server: RunningServer, sdk: Any
) -> None:
    client, _ = sdk(chat_server)
    made = await client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)

    with pytest.raises(openai.BadRequestError):
        await client.responses.cancel(made.id)
    with pytest.raises(openai.BadRequestError):
        await client.responses.retrieve(made.id, stream=True)


async def test_deleting_a_running_background_response_cancels_it(
    chat_server: RunningServer, sdk: Any
) -> None:
    client, _ = sdk(chat_server)
    chat_server.recorder.pace(PACE_S)
    made = await client.responses.create(model=MODEL, input="Hi", max_output_tokens=400,
                                         background=True)

    await client.responses.delete(made.id)
    finish = await chat_server.wait_finished(request_id(made.id))

    assert finish.reason is FinishReason.CANCELLED
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(made.id)
