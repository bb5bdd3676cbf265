"""The Responses API (``/v1/responses``) as the official ``openai`` SDK uses it, over real
HTTP on loopback, on the tiny model with a ChatML template (``chat_server``): streamed
and whole answers, the stream helper, stored responses, a ``previous_response_id``
chain, and the refusals. The fixture's checks hold after each test: no stream open,
the cache whole, releases == admitted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from app.settings import Settings
from engine.engine import Engine
from engine.model import LoadedModel
from tests import test_openai_sdk
from tests.http_server import RecordingEngine, RunningServer, StartServer
from tests.test_openai_sdk import wire_lines, with_chat_template

sdk = test_openai_sdk.sdk  # the fixture: an AsyncOpenAI client of a server

MODEL = "tiny"
KEY_A, KEY_B = "key-a-" + "0" * 32, "key-b-" + "1" * 32


async def serve(start_server: StartServer, tiny_model: Callable[[str], LoadedModel],
                *, ends_at_once: bool = False, **settings: Any) -> RunningServer:
    """A server whose tiny model has a ChatML chat template, served as ``tiny``;
    ``ends_at_once``: every token is an end of sequence (an answer of one token, ended
    by the model: ``completed``, where the random model would otherwise run to its
    ``max_output_tokens``)."""
    loaded = with_chat_template(tiny_model("tiny-gpt2"))
    eos = frozenset(range(loaded.model.config.vocab_size)) if ends_at_once else None

    def make_engine(s: Settings) -> RecordingEngine:
        return RecordingEngine(Engine(loaded, max_batch=s.max_batch,
                                      num_blocks=s.cache_blocks, block_size=s.block_size,
                                      eos_token_ids=eos))

    return await start_server(make_engine=make_engine, model_name=MODEL, **settings)


@pytest.fixture
async def chat_server(start_server: StartServer,
                      tiny_model: Callable[[str], LoadedModel]) -> RunningServer:
    return await serve(start_server, tiny_model)


async def test_a_whole_response_is_the_stored_one(chat_server: RunningServer, sdk: Any) -> None:
    client, _ = sdk(chat_server)

    answer = await client.responses.create(model=MODEL, input="The capital of France is",
                                           instructions="Answer briefly.",
                                           max_output_tokens=5, temperature=0)
    again = await client.responses.retrieve(answer.id)

    assert answer.status == "incomplete"  # 5 tokens, cut
    assert answer.incomplete_details is not None
    assert answer.incomplete_details.reason == "max_output_tokens"
    assert answer.output_text and answer.usage is not None
    assert answer.usage.output_tokens == 5
    assert again.model_dump() == answer.model_dump()


async def test_a_streamed_response_equals_the_whole_one(
    chat_server: RunningServer, sdk: Any
) -> None:
    client, tee = sdk(chat_server)
    fields: dict[str, Any] = {"model": MODEL, "input": "The capital of France is",
                              "max_output_tokens": 6, "temperature": 0}

    whole = await client.responses.create(**fields)
    events = [e async for e in await client.responses.create(**fields, stream=True)]

    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    assert events[0].response.status == "in_progress"  # as OpenAI's, in the foreground
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    assert events[-1].response.output_text == whole.output_text
    assert not [line for line in wire_lines(bytes(tee.raw)) if line.startswith(b"id:")]


async def test_the_stream_helper_gives_the_final_response(
    start_server: StartServer, tiny_model: Callable[[str], LoadedModel], sdk: Any
) -> None:
    client, _ = sdk(await serve(start_server, tiny_model, ends_at_once=True))

    deltas = []
    async with client.responses.stream(model=MODEL, input="Hello", max_output_tokens=4,
                                       temperature=0) as stream:
        async for event in stream:
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = await stream.get_final_response()

    assert final.status == "completed"
    assert final.output_text == "".join(deltas)
    assert (await client.responses.retrieve(final.id)).output_text == final.output_text


async def test_a_chain_of_three_turns_continues_the_conversation(
    chat_server: RunningServer, sdk: Any
) -> None:
    client, _ = sdk(chat_server)
    fields: dict[str, Any] = {"model": MODEL, "max_output_tokens": 3, "temperature": 0}

    first = await client.responses.create(input="One", **fields)
    second = await client.responses.create(input="Two", previous_response_id=first.id,
                                           **fields)
    third = await client.responses.create(input=[{"role": "user", "content": "Three"}],
                                          previous_response_id=second.id, **fields)
    whole = await client.responses.create(input=[
        {"role": "user", "content": "One"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Two"},
        {"role": "assistant", "content": second.output_text},
        {"role": "user", "content": "Three"}], **fields)
    items = await client.responses.input_items.list(third.id)

    assert third.previous_response_id == second.id
    assert third.usage is not None and whole.usage is not None
    assert third.usage.input_tokens == whole.usage.input_tokens  # the same conversation
    assert third.output_text == whole.output_text
    assert [i.content[0].text for i in items.data] == ["Three"]  # its own input only


async def test_input_items_list_newest_first_with_ids(
    chat_server: RunningServer, sdk: Any
) -> None:
    client, _ = sdk(chat_server)
    answer = await client.responses.create(model=MODEL, max_output_tokens=2, input=[
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}])

    listed = await client.responses.input_items.list(answer.id)
    oldest_first = await client.responses.input_items.list(answer.id, order="asc", limit=1)

    assert [(i.role, i.content[0].text) for i in listed.data] == [
        ("user", "Hi"), ("developer", "Be brief.")]
    assert len({i.id for i in listed.data}) == 2
    assert [i.role for i in oldest_first.data] == ["developer"] and oldest_first.has_more


async def test_a_deleted_response_is_gone(chat_server: RunningServer, sdk: Any) -> None:
    client, _ = sdk(chat_server)
    answer = await client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)

    await client.responses.delete(answer.id)

    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(answer.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.delete(answer.id)


async def test_store_false_keeps_nothing(chat_server: RunningServer, sdk: Any) -> None:
    client, _ = sdk(chat_server)
    answer = await client.responses.create(model=MODEL, input="Hi", max_output_tokens=2,
                                           store=False)

    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(answer.id)
    with pytest.raises(openai.NotFoundError) as caught:
        await client.responses.create(model=MODEL, input="Hi", previous_response_id=answer.id)
    assert caught.value.response.status_code == 404


@pytest.mark.parametrize(("fields", "param"), [
    ({"truncation": "auto"}, "truncation"),
    ({"reasoning": {"mode": "pro"}}, "reasoning.mode"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     None),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0]"),
    ({"include": ["file_search_call.results"]}, "include[0]"),
    ({"background": True, "store": False}, None),
    ({"frobnicate": 1}, "frobnicate"),
])
async def test_what_is_not_implemented_is_refused_before_anything_runs(
    chat_server: RunningServer, sdk: Any, fields: dict[str, Any], param: str | None
) -> None:
    client, _ = sdk(chat_server)
    body = {"model": MODEL, "input": "Hi", **fields}

    with pytest.raises(openai.BadRequestError) as caught:
        await client.responses.create(**body) if "frobnicate" not in body else \
            await client.post("/responses", body=body, cast_to=httpx.Response)

    assert caught.value.response.headers["x-should-retry"] == "false"
    if param is not None:
        assert caught.value.param == param
    assert chat_server.recorder.submitted == []


async def test_another_keys_response_is_not_found(
    start_server: StartServer, tiny_model: Callable[[str], LoadedModel], sdk: Any
) -> None:
    keys = f'[{{"name": "a", "key": "{KEY_A}"}}, {{"name": "b", "key": "{KEY_B}"}}]'
    server = await serve(start_server, tiny_model, api_keys=keys)
    a, _ = sdk(server)
    b, _ = sdk(server)
    a.api_key, b.api_key = KEY_A, KEY_B
    made = await a.responses.create(model=MODEL, input="Hi", max_output_tokens=2)

    for call in (b.responses.retrieve(made.id), b.responses.delete(made.id),
                 b.responses.input_items.list(made.id),
                 b.responses.create(model=MODEL, input="Hi", previous_response_id=made.id)):
        with pytest.raises(openai.NotFoundError):
            await call
    assert (await a.responses.retrieve(made.id)).id == made.id
