"""``/v1/messages`` as the official ``anthropic`` SDK uses it, over real HTTP.

Every test drives ``anthropic.AsyncAnthropic`` against a real hypercorn on loopback (the
fixture's checks hold after each: no stream open, cache whole, releases == admitted).
The newest SDK has no ``temperature``, ``top_p`` or ``top_k`` arguments: they go in
``extra_body``, as a client of it sends them. The tiny test models have no chat
template; ``chat_server`` gives its engine the ChatML one the OpenAI tests use, and an
engine that never meets an end-of-sequence token (``eos_token_ids`` empty), so that a
long answer runs until its client leaves. One smoke test serves the embedded SmolLM2
with its own template.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import anthropic
import pytest

from app.settings import Settings
from engine import FinishReason
from engine.engine import Engine
from engine.model import LoadedModel
from tests.http_server import SETTLE_TIMEOUT_S, RecordingEngine, RunningServer, StartServer
from tests.test_app_metrics import scrape, value
from tests.test_openai_sdk import with_chat_template

MODEL = "tiny"  # the chat server's alias
KEY = "sk-ant-test-0123456789abcdefghijklmnop"  # at least 32 characters
GREEDY = {"temperature": 0}  # through extra_body, as the newest SDK sends it
QUESTION: list[Any] = [{"role": "user", "content": "The capital of France is"}]
LONG_MAX_TOKENS = 400  # no end-of-sequence token: runs until cancelled (context: 512)


def tiny_engine(loaded: LoadedModel, **options: Any) -> Callable[[Settings], RecordingEngine]:
    def make(s: Settings) -> RecordingEngine:
        return RecordingEngine(Engine(loaded, max_batch=s.max_batch, num_blocks=s.cache_blocks,
                                      block_size=s.block_size, **options))

    return make


@pytest.fixture
def chat_model(tiny_model: Callable[[str], LoadedModel]) -> LoadedModel:
    return with_chat_template(tiny_model("tiny-gpt2"))


@pytest.fixture
async def chat_server(start_server: StartServer, chat_model: LoadedModel) -> RunningServer:
    """A server whose tiny model has a ChatML template and never ends a sequence by
    itself (no end-of-sequence token)."""
    return await start_server(make_engine=tiny_engine(chat_model, eos_token_ids=frozenset()),
                              model_name=MODEL)


@pytest.fixture
async def sdk() -> AsyncIterator[Callable[..., anthropic.AsyncAnthropic]]:
    """``sdk(server, **options)``: an AsyncAnthropic client of ``server``, no retries."""
    clients: list[anthropic.AsyncAnthropic] = []

    def make(server: RunningServer, **options: Any) -> anthropic.AsyncAnthropic:
        options = {"api_key": "unused", "max_retries": 0, "timeout": SETTLE_TIMEOUT_S,
                   **options}
        client = anthropic.AsyncAnthropic(base_url=server.base_url, **options)
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.close()


# -- answers --------------------------------------------------------------------------


async def test_create_answers_a_message_with_usage(chat_server: RunningServer, sdk: Any) -> None:
    client = sdk(chat_server)

    message = await client.messages.create(model=MODEL, max_tokens=5, messages=QUESTION,
                                           extra_body=GREEDY)

    assert (message.type, message.role, message.model) == ("message", "assistant", MODEL)
    assert message.id.startswith("msg_")
    assert [block.type for block in message.content] == ["text"]
    assert (message.stop_reason, message.stop_sequence) == ("max_tokens", None)
    assert message.usage.output_tokens == 5
    assert message.usage.input_tokens > 0


async def test_stream_text_equals_the_whole_message(chat_server: RunningServer, sdk: Any) -> None:
    client = sdk(chat_server)
    fields: dict[str, Any] = {"model": MODEL, "max_tokens": 8, "messages": QUESTION,
                              "system": "Answer briefly.", "extra_body": GREEDY}
    whole = await client.messages.create(**fields)

    async with client.messages.stream(**fields) as stream:
        text = "".join([delta async for delta in stream.text_stream])
        final = await stream.get_final_message()

    assert text == whole.content[0].text == final.content[0].text
    assert len(text) > 0
    assert final.stop_reason == whole.stop_reason == "max_tokens"
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert final.usage.output_tokens == whole.usage.output_tokens == 8


async def test_create_with_stream_gives_the_event_sequence(
    chat_server: RunningServer, sdk: Any
) -> None:
    client = sdk(chat_server)

    stream = await client.messages.create(model=MODEL, max_tokens=4, messages=QUESTION,
                                          stream=True, extra_body=GREEDY)
    events = [event async for event in stream]

    kinds = [event.type for event in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert set(kinds[2:-3]) <= {"content_block_delta"}
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert events[0].message.usage.output_tokens == 0
    assert events[-2].delta.stop_reason == "max_tokens"
    assert events[-2].usage.output_tokens == 4


@pytest.mark.parametrize("others", [[], ["\u2603", "\u2604"]], ids=["one", "several"])
async def test_stop_sequence_ends_the_answer_and_is_named(
    chat_server: RunningServer, sdk: Any, others: list[str]
) -> None:
    client = sdk(chat_server)
    fields: dict[str, Any] = {"model": MODEL, "max_tokens": 12, "messages": QUESTION,
                              "extra_body": GREEDY}
    text = (await client.messages.create(**fields)).content[0].text
    assert len(text) >= 5
    stop = text[3:5]
    stops = [*others[:1], stop, *others[1:]]

    whole = await client.messages.create(**fields, stop_sequences=stops)
    async with client.messages.stream(**fields, stop_sequences=stops) as stream:
        final = await stream.get_final_message()

    for message in (whole, final):
        assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
        assert message.content[0].text == text[:text.index(stop)]


async def test_answer_that_meets_the_end_of_sequence_ends_its_turn(
    start_server: StartServer, chat_model: LoadedModel, sdk: Any
) -> None:
    every_token_ends = frozenset(range(chat_model.model.config.vocab_size))
    server = await start_server(make_engine=tiny_engine(chat_model,
                                                        eos_token_ids=every_token_ends))
    client = sdk(server)

    message = await client.messages.create(model="tiny-gpt2", max_tokens=8, messages=QUESTION)

    assert (message.stop_reason, message.stop_sequence) == ("end_turn", None)
    assert message.usage.output_tokens == 1


async def test_count_tokens_is_the_prompt_that_create_reports(
    chat_server: RunningServer, sdk: Any
) -> None:
    client = sdk(chat_server)
    rendered = ("<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\n"
                "The capital of France is<|im_end|>\n<|im_start|>assistant\n")

    counted = await client.messages.count_tokens(model=MODEL, messages=QUESTION,
                                                 system="Answer briefly.")
    message = await client.messages.create(model=MODEL, max_tokens=1, messages=QUESTION,
                                           system="Answer briefly.")

    assert counted.input_tokens == len(chat_server.recorder.tokenize(rendered))
    assert counted.input_tokens == message.usage.input_tokens
    assert len(chat_server.recorder.submitted) == 1  # counting submits nothing


# -- a client that leaves -------------------------------------------------------------


async def test_stream_closed_early_is_cancelled_within_one_step(
    chat_server: RunningServer, sdk: Any
) -> None:
    client = sdk(chat_server)
    texts: list[str] = []

    async with client.messages.stream(model=MODEL, max_tokens=LONG_MAX_TOKENS,
                                      messages=QUESTION, extra_body=GREEDY) as stream:
        async for event in stream:
            if event.type == "content_block_delta":
                texts.append(event.delta.text)
            if len(texts) == 3:
                break
        (request_id,) = chat_server.recorder.submitted
        chat_server.recorder.hold()  # it cannot end before the server notices it is gone
    await chat_server.wait_for(lambda: request_id in chat_server.recorder.cancel_marks,
                               "the cancel")
    chat_server.recorder.release()
    finish = await chat_server.wait_finished(request_id)

    assert finish.reason is FinishReason.CANCELLED
    assert 3 <= finish.completion_tokens <= chat_server.recorder.cancel_marks[request_id] + 1
    assert finish.completion_tokens < LONG_MAX_TOKENS


# -- refusals, each as the SDK's typed exception --------------------------------------


@pytest.mark.parametrize(("fields", "named"), [
    ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "iVBORw0KGgo="}}]}]},
     "messages.0.content: block 0 is of type 'image'"),
    ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Read this"},
        {"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                        "data": "x"}}]}]},
     "messages.0.content: block 1 is of type 'document'"),
    ({"tools": [{"name": "get_weather", "input_schema": {"type": "object"}}],
      "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice:"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking:"),
    ({"extra_body": {"frequency_penalty": 1}}, "frequency_penalty: Extra inputs"),
    ({"max_tokens": 10_000}, "max_tokens: must be at most"),
    ({"messages": [*QUESTION, {"role": "assistant", "content": "Paris"}]}, "messages:"),
])
async def test_unsupported_requests_are_bad_requests_naming_the_field(
    chat_server: RunningServer, sdk: Any, fields: dict[str, Any], named: str
) -> None:
    client = sdk(chat_server)

    with pytest.raises(anthropic.BadRequestError) as caught:
        await client.messages.create(**{"model": MODEL, "max_tokens": 4,
                                        "messages": QUESTION, **fields})

    assert caught.value.status_code == 400
    assert caught.value.type == "invalid_request_error"
    assert caught.value.body["type"] == "error"
    assert named in str(caught.value.api_message)
    assert caught.value.response.headers["x-should-retry"] == "false"
    assert chat_server.recorder.submitted == []


async def test_unknown_model_is_not_found(chat_server: RunningServer, sdk: Any) -> None:
    client = sdk(chat_server)

    with pytest.raises(anthropic.NotFoundError) as caught:
        await client.messages.create(model="claude-sonnet-4-5", max_tokens=4, messages=QUESTION)
    with pytest.raises(anthropic.NotFoundError):
        await client.messages.count_tokens(model="claude-sonnet-4-5", messages=QUESTION)

    assert caught.value.type == "not_found_error"
    assert chat_server.recorder.submitted == []


async def test_body_over_the_limit_is_request_too_large(
    chat_server: RunningServer, sdk: Any
) -> None:
    client = sdk(chat_server)
    limit = chat_server.app.runtime.settings.max_body_bytes

    with pytest.raises(anthropic.RequestTooLargeError) as caught:
        await client.messages.create(model=MODEL, max_tokens=4, messages=[
            {"role": "user", "content": "x" * limit}])

    assert caught.value.status_code == 413
    assert caught.value.type == "request_too_large"


async def test_api_key_is_taken_as_x_api_key_or_bearer(
    start_server: StartServer, chat_model: LoadedModel, sdk: Any
) -> None:
    server = await start_server(make_engine=tiny_engine(chat_model), api_key=KEY)

    with pytest.raises(anthropic.AuthenticationError) as caught:
        await sdk(server, api_key="sk-ant-wrong-key").messages.create(
            model="tiny-gpt2", max_tokens=2, messages=QUESTION)
    by_x_api_key = await sdk(server, api_key=KEY).messages.create(
        model="tiny-gpt2", max_tokens=2, messages=QUESTION)
    by_bearer = await sdk(server, api_key=None, auth_token=KEY).messages.count_tokens(
        model="tiny-gpt2", messages=QUESTION)

    assert caught.value.type == "authentication_error"
    assert by_x_api_key.usage.input_tokens == by_bearer.input_tokens > 0
    assert len(server.recorder.submitted) == 1


async def test_key_at_its_stream_limit_is_rate_limited_with_retry_after(
    start_server: StartServer, chat_model: LoadedModel, sdk: Any
) -> None:
    server = await start_server(make_engine=tiny_engine(chat_model), model_name=MODEL,
                                api_keys=[{"name": "ci", "key": KEY, "max_streams": 1}])
    client = sdk(server, api_key=KEY)
    server.recorder.hold()  # the first stream stays open

    async with client.messages.stream(model=MODEL, max_tokens=2, messages=QUESTION) as first:
        with pytest.raises(anthropic.RateLimitError) as caught:
            await client.messages.create(model=MODEL, max_tokens=2, messages=QUESTION)
        server.recorder.release()
        final = await first.get_final_message()

    assert caught.value.type == "rate_limit_error"
    assert int(caught.value.response.headers["retry-after"]) >= 1
    assert "x-should-retry" not in caught.value.response.headers
    assert final.stop_reason in ("max_tokens", "end_turn")


async def test_waiting_limit_is_overloaded_with_retry_after(
    start_server: StartServer, chat_model: LoadedModel, sdk: Any
) -> None:
    server = await start_server(make_engine=tiny_engine(chat_model), model_name=MODEL,
                                max_waiting=1)
    client = sdk(server)
    server.recorder.hold()  # the first request waits for its first token

    async with client.messages.stream(model=MODEL, max_tokens=2, messages=QUESTION) as first:
        with pytest.raises(anthropic.OverloadedError) as caught:
            await client.messages.create(model=MODEL, max_tokens=2, messages=QUESTION)
        server.recorder.release()
        await first.get_final_message()

    assert caught.value.status_code == 529
    assert caught.value.type == "overloaded_error"
    assert "too_many_waiting" in str(caught.value.api_message)
    assert int(caught.value.response.headers["retry-after"]) >= 1


async def test_draining_server_is_overloaded(chat_server: RunningServer, sdk: Any) -> None:
    client = sdk(chat_server)
    chat_server.app.runtime.drain("the test drains it")

    with pytest.raises(anthropic.OverloadedError) as caught:
        await client.messages.create(model=MODEL, max_tokens=2, messages=QUESTION)

    assert caught.value.status_code == 529
    assert "shutdown" in str(caught.value.api_message)
    assert int(caught.value.response.headers["retry-after"]) >= 1


async def test_failure_mid_stream_raises_the_error_event(
    chat_server: RunningServer, sdk: Any
) -> None:
    client = sdk(chat_server)
    texts: list[str] = []

    with pytest.raises(anthropic.APIStatusError) as caught:
        async with client.messages.stream(model=MODEL, max_tokens=LONG_MAX_TOKENS,
                                          messages=QUESTION) as stream:
            async for text in stream.text_stream:
                texts.append(text)
                if len(texts) == 3:
                    chat_server.recorder.fail(chat_server.recorder.submitted[0])

    assert caught.value.body["error"]["type"] == "api_error"
    assert str(caught.value.body["error"]["message"]).startswith("engine_error: ")
    assert len(texts) >= 3


# -- metrics --------------------------------------------------------------------------


async def test_metrics_count_the_route(chat_server: RunningServer, sdk: Any) -> None:
    client = sdk(chat_server)
    whole = await client.messages.create(model=MODEL, max_tokens=3, messages=QUESTION)
    async with client.messages.stream(model=MODEL, max_tokens=5, messages=QUESTION) as stream:
        streamed = await stream.get_final_message()
    with pytest.raises(anthropic.BadRequestError):
        await client.messages.create(model=MODEL, max_tokens=3, messages=QUESTION,
                                     extra_body={"tools": [{"name": "f"}]})

    samples = await scrape(chat_server)

    assert value(samples, "streamscope_requests_finished_total", finish_reason="length") == 2
    assert value(samples, "streamscope_generation_tokens_total") == 3 + 5
    assert value(samples, "streamscope_prompt_tokens_total") == (
        whole.usage.input_tokens + streamed.usage.input_tokens)
    assert value(samples, "streamscope_time_to_first_token_seconds_count") == 2
    assert value(samples, "streamscope_refusals_total",
                 status="400", type="invalid_request") == 1


# -- the embedded model ---------------------------------------------------------------


@pytest.mark.smoke
async def test_smollm2_answers_through_its_own_chat_template(
    start_server: StartServer, sdk: Any, embedded_model: LoadedModel
) -> None:
    server = await start_server(make_engine=tiny_engine(embedded_model), model_name="smollm2")
    client = sdk(server)
    question = [{"role": "user", "content": "What is the capital of France?"}]

    counted = await client.messages.count_tokens(model="smollm2", messages=question)
    message = await client.messages.create(model="smollm2", max_tokens=24, messages=question,
                                           extra_body=GREEDY)

    assert "Paris" in message.content[0].text
    assert message.stop_reason == "end_turn"
    assert message.usage.input_tokens == counted.input_tokens
