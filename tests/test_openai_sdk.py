"""The OpenAI-compatible routes as the official ``openai`` SDK uses them, over real HTTP.

Every test drives ``openai.AsyncOpenAI`` against a real hypercorn on loopback (the
fixture's checks hold after each: no stream open, cache whole, releases == admitted).
The SDK's HTTP client goes through ``TeeTransport``, which keeps the raw bytes the SDK
read, so a test can also check the wire (no ``event:``/``id:``/``retry:`` lines).

The tiny test models have no chat template; ``chat_server`` gives its engine a copy of
the tokenizer with a small ChatML template, and one test checks the refusal without.
"""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

import httpx
import openai
import pytest
import trio

from app.settings import Settings
from engine.engine import Engine
from engine.model import LoadedModel
from tests.http_server import SETTLE_TIMEOUT_S, RecordingEngine, RunningServer, StartServer

MODEL = "tiny-gpt2"  # the test server's model setting: its served name
CHATML = (
    "{% for m in messages %}{% if loop.first and m['role'] == 'assistant' %}"
    "{{ raise_exception('a conversation cannot open with the assistant') }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QUESTION = [{"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "The capital of France is"}]


class TeeTransport(httpx.AsyncBaseTransport):
    """httpx's own transport, keeping every response byte the client reads in ``raw``;
    ``keepalive`` is set once a keep-alive comment came; ``requests`` counts requests."""

    def __init__(self) -> None:
        self._inner = httpx.AsyncHTTPTransport()
        self.raw = bytearray()
        self.keepalive = trio.Event()
        self.requests = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.requests += 1
        response = await self._inner.handle_async_request(request)
        return httpx.Response(response.status_code, headers=response.headers,
                              stream=_Tee(self, response), extensions=response.extensions)

    async def aclose(self) -> None:
        await self._inner.aclose()


class _Tee(httpx.AsyncByteStream):
    def __init__(self, tee: TeeTransport, response: httpx.Response) -> None:
        self._tee, self._response = tee, response

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._response.aiter_raw():
            self._tee.raw += chunk
            if b": keep-alive\n" in self._tee.raw:
                self._tee.keepalive.set()
            yield chunk

    async def aclose(self) -> None:
        await self._response.aclose()



@pytest.fixture
async def sdk() -> AsyncIterator[Callable[..., tuple[openai.AsyncOpenAI, TeeTransport]]]:
    """``sdk(server, max_retries=0)``: an AsyncOpenAI client of ``server`` and its tee."""
    clients: list[openai.AsyncOpenAI] = []

    def make(server: RunningServer, max_retries: int = 0) -> tuple[openai.AsyncOpenAI,
                                                                    TeeTransport]:
        tee = TeeTransport()
        client = openai.AsyncOpenAI(
            base_url=f"{server.base_url}/v1", api_key="unused", max_retries=max_retries,
            http_client=httpx.AsyncClient(transport=tee, timeout=SETTLE_TIMEOUT_S),
        )
        clients.append(client)
        return client, tee

    yield make
    for client in clients:
        await client.close()


def with_chat_template(loaded: LoadedModel, template: str = CHATML) -> LoadedModel:
    tokenizer = copy.deepcopy(loaded.tokenizer)
    tokenizer.chat_template = template
    return replace(loaded, tokenizer=tokenizer)


@pytest.fixture
async def chat_server(
    start_server: StartServer, tiny_model: Callable[[str], LoadedModel]
) -> RunningServer:
    """A server whose tiny model has a ChatML chat template."""
    loaded = with_chat_template(tiny_model(MODEL))

    def make_engine(s: Settings) -> RecordingEngine:
        return RecordingEngine(Engine(loaded, max_batch=s.max_batch,
                                      num_blocks=s.cache_blocks, block_size=s.block_size))

    return await start_server(make_engine=make_engine, model_name="tiny")


def wire_lines(raw: bytes) -> list[bytes]:
    return [line for line in raw.split(b"\n") if line]


# -- models ---------------------------------------------------------------------------


async def test_models_list_the_model_and_its_alias(start_server: StartServer, sdk: Any) -> None:
    client, _ = sdk(await start_server(model_name="tiny"))

    listed = [m async for m in client.models.list()]
    one = await client.models.retrieve("tiny")

    assert [(m.id, m.object, m.owned_by) for m in listed] == [
        (MODEL, "model", "streamscope"), ("tiny", "model", "streamscope")]
    assert one.id == "tiny"
    assert one.created == listed[0].created > 0


async def test_unknown_model_is_not_found(server: RunningServer, sdk: Any) -> None:
    client, _ = sdk(server)

    with pytest.raises(openai.NotFoundError) as caught:
        await client.completions.create(model="gpt-4o", prompt="Hi", max_tokens=2)

    assert caught.value.code == "model_not_found"
    assert caught.value.param == "model"
    assert caught.value.response.headers["x-should-retry"] == "false"
    assert server.recorder.submitted == []


async def test_any_model_is_accepted_under_star(start_server: StartServer, sdk: Any) -> None:
    client, _ = sdk(await start_server(model_name="*"))

    answer = await client.completions.create(model="gpt-4o", prompt="Hi", max_tokens=2)
    listed = [m.id async for m in client.models.list()]

    assert answer.model == MODEL  # the served name, not the client's (issue 33)
    assert listed == [MODEL]


# -- completions ----------------------------------------------------------------------


async def test_streamed_completion_equals_the_whole_one_with_usage(
    server: RunningServer, sdk: Any
) -> None:
    client, tee = sdk(server)
    fields: dict[str, Any] = {"model": MODEL, "prompt": "The capital of France is",
                              "max_tokens": 6, "temperature": 0}

    whole = await client.completions.create(**fields)
    chunks = [c async for c in await client.completions.create(
        **fields, stream=True, stream_options={"include_usage": True})]

    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks[-2:-1]] == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1])
    assert {(c.id, c.created) for c in chunks} == {(chunks[0].id, chunks[0].created)}
    assert not [line for line in wire_lines(bytes(tee.raw))
                if line.startswith((b"event:", b"id:", b"retry:"))]


async def test_ignore_eos_passes_through_extra_body(
    start_server: StartServer, tiny_model: Callable[[str], LoadedModel], sdk: Any
) -> None:
    loaded = tiny_model(MODEL)
    every_token_ends = frozenset(range(loaded.model.config.vocab_size))
    server = await start_server(make_engine=lambda s: RecordingEngine(Engine(
        loaded, max_batch=s.max_batch, num_blocks=s.cache_blocks, block_size=s.block_size,
        eos_token_ids=every_token_ends)))
    client, _ = sdk(server)

    plain = await client.completions.create(model=MODEL, prompt="Hi", max_tokens=12)
    ignoring = await client.completions.create(
        model=MODEL, prompt="Hi", max_tokens=12, extra_body={"ignore_eos": True})

    assert (plain.choices[0].finish_reason, ignoring.choices[0].finish_reason) == (
        "stop", "length")
    assert ignoring.usage is not None and ignoring.usage.completion_tokens == 12


async def test_top_k_passes_through_extra_body(server: RunningServer, sdk: Any) -> None:
    client, _ = sdk(server)
    fields: dict[str, Any] = {"model": MODEL, "prompt": "The capital of France is",
                              "max_tokens": 8}

    greedy = await client.completions.create(**fields, temperature=0)
    top_1 = await client.completions.create(**fields, temperature=1, seed=7,
                                            extra_body={"top_k": 1})

    assert top_1.choices[0].text == greedy.choices[0].text


# -- chat -----------------------------------------------------------------------------


async def test_whole_chat_answer_is_the_assistants(chat_server: RunningServer, sdk: Any) -> None:
    client, _ = sdk(chat_server)

    answer = await client.chat.completions.create(
        model="tiny", messages=QUESTION, max_completion_tokens=5, temperature=0)

    assert answer.object == "chat.completion"
    assert answer.model == "tiny"
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage is not None
    assert (answer.usage.completion_tokens, answer.usage.total_tokens) == (
        5, answer.usage.prompt_tokens + 5)


async def test_chat_prompt_is_the_rendered_template(chat_server: RunningServer, sdk: Any) -> None:
    client, _ = sdk(chat_server)
    rendered = ("<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\n"
                "The capital of France is<|im_end|>\n<|im_start|>assistant\n")
    expected = len(chat_server.recorder.tokenize(rendered))

    answer = await client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2)
    parts = await client.chat.completions.create(
        model=MODEL, max_tokens=2, messages=[
            QUESTION[0], {"role": "user", "content": [{"type": "text", "text": "The capital"},
                                                      {"type": "text", "text": "of France is"}]}])

    assert answer.usage is not None and answer.usage.prompt_tokens == expected
    assert parts.usage is not None
    assert parts.usage.prompt_tokens == len(chat_server.recorder.tokenize(
        rendered.replace("The capital of", "The capital\nof")))


async def test_usage_counts_the_prompt_tokens_found_in_the_prefix_cache(
    start_server: StartServer, tiny_model: Callable[[str], LoadedModel], sdk: Any
) -> None:
    loaded = with_chat_template(tiny_model(MODEL))

    def make_engine(s: Settings) -> RecordingEngine:
        return RecordingEngine(Engine(loaded, max_batch=s.max_batch, num_blocks=s.cache_blocks,
                                      block_size=s.block_size, prefix_cache=True))

    server = await start_server(make_engine=make_engine, model_name="tiny")
    client, _ = sdk(server)
    fields: dict[str, Any] = {"model": "tiny", "max_tokens": 2, "temperature": 0, "messages": [
        {"role": "system", "content": "Answer in one word, and never more than one. " * 4},
        {"role": "user", "content": "Name a colour."}]}

    first = await client.chat.completions.create(**fields)
    hits_before = server.recorder.statistics().prefix_cache_hits
    again = [c async for c in await client.chat.completions.create(
        **fields, stream=True, stream_options={"include_usage": True})][-1].usage

    assert first.usage is not None and again is not None
    assert first.usage.prompt_tokens_details is not None and again.prompt_tokens_details
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # a cold cache
    cached = again.prompt_tokens_details.cached_tokens
    assert cached == server.recorder.statistics().prefix_cache_hits - hits_before
    assert 0 < cached < again.prompt_tokens == first.usage.prompt_tokens


async def test_streamed_chat_equals_the_whole_answer_with_usage_last(
    chat_server: RunningServer, sdk: Any
) -> None:
    client, _ = sdk(chat_server)
    fields: dict[str, Any] = {"model": "tiny", "messages": QUESTION, "max_tokens": 6,
                              "temperature": 0}

    whole = await client.chat.completions.create(**fields)
    chunks = [c async for c in await client.chat.completions.create(
        **fields, stream=True, stream_options={"include_usage": True})]

    first, *middle, last, totals = chunks
    assert (first.choices[0].delta.role, first.choices[0].delta.content) == ("assistant", "")
    assert "".join(c.choices[0].delta.content or "" for c in middle) == (
        whole.choices[0].message.content)
    assert last.choices[0].finish_reason == whole.choices[0].finish_reason == "length"
    assert totals.choices == [] and totals.usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1])
    assert {(c.id, c.created, c.object) for c in chunks} == {
        (first.id, first.created, "chat.completion.chunk")}


async def test_stream_helper_gives_the_final_completion(
    chat_server: RunningServer, sdk: Any
) -> None:
    client, _ = sdk(chat_server)
    fields: dict[str, Any] = {"model": "tiny", "messages": QUESTION, "max_tokens": 8,
                              "temperature": 0}
    text = (await client.chat.completions.create(**fields)).choices[0].message.content
    assert text is not None and len(text) >= 5
    fields["stop"] = text[3:5]  # the helper refuses a "length" finish: end on a stop
    whole = await client.chat.completions.create(**fields)

    async with client.chat.completions.stream(**fields) as stream:
        final = await stream.get_final_completion()

    assert final.choices[0].message.content == whole.choices[0].message.content == (
        text[:text.index(text[3:5])])
    assert final.choices[0].finish_reason == "stop"


async def test_stream_reads_across_keepalive_comments(
    start_server: StartServer, tiny_model: Callable[[str], LoadedModel], sdk: Any
) -> None:
    loaded = with_chat_template(tiny_model(MODEL))
    server = await start_server(keepalive_s=0.05, make_engine=lambda s: RecordingEngine(
        Engine(loaded, max_batch=s.max_batch, num_blocks=s.cache_blocks,
               block_size=s.block_size)))
    client, tee = sdk(server)
    fields: dict[str, Any] = {"model": MODEL, "messages": QUESTION, "max_tokens": 3,
                              "temperature": 0}
    whole = await client.chat.completions.create(**fields)
    server.recorder.hold()
    chunks: list[Any] = []

    async def read_all() -> None:
        chunks.extend([c async for c in await client.chat.completions.create(
            **fields, stream=True)])

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read_all)
        with trio.fail_after(SETTLE_TIMEOUT_S):
            await tee.keepalive.wait()  # the stream is open and idle
        server.recorder.release()

    assert "".join(c.choices[0].delta.content or "" for c in chunks) == (
        whole.choices[0].message.content)
    assert chunks[-1].choices[0].finish_reason == "length"


async def test_failure_mid_stream_raises_api_error_after_the_tokens(
    chat_server: RunningServer, sdk: Any
) -> None:
    client, tee = sdk(chat_server)
    stream = await client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=400, stream=True,
        extra_body={"ignore_eos": True})
    chunks = [await anext(aiter(stream)) for _ in range(3)]
    # At once after the reads: the engine is a few steps ahead of them, far from 400.
    chat_server.recorder.fail(stream.response.headers["x-request-id"])

    with pytest.raises(openai.APIError) as caught:
        async for chunk in stream:
            chunks.append(chunk)

    assert caught.value.code == "engine_error"
    assert chunks[0].choices[0].delta.role == "assistant"
    tail = wire_lines(bytes(tee.raw))[-2:]
    assert tail[0].startswith(b'data: {"error":{"message":')
    assert tail[1] == b"data: [DONE]"


# -- refusals -------------------------------------------------------------------------


@pytest.mark.parametrize(("fields", "param"), [
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"n": 9}, "n"),
    ({"logit_bias": {"42": 101}}, "logit_bias"),
    ({"logit_bias": {"-1": 5}}, "logit_bias"),
    ({"presence_penalty": -3}, "presence_penalty"),
    ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"extra_body": {"min_tokens": 2}}, "min_tokens"),
    ({"max_completion_tokens": 10_000}, "max_completion_tokens"),
    ({"messages": [{"role": "function", "content": "x", "name": "f"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:,"}}]}]},
     "messages[0].content"),
])
async def test_unsupported_requests_are_bad_requests(
    chat_server: RunningServer, sdk: Any, fields: dict[str, Any], param: str
) -> None:
    client, _ = sdk(chat_server)

    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(**{"model": MODEL, "messages": QUESTION, **fields})

    assert caught.value.status_code == 400
    assert caught.value.param == param
    assert caught.value.code == "invalid_request"
    assert caught.value.response.headers["x-should-retry"] == "false"
    assert chat_server.recorder.submitted == []


async def test_neutral_values_of_unsupported_fields_are_accepted(
    chat_server: RunningServer, sdk: Any
) -> None:
    client, _ = sdk(chat_server)

    answer = await client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=2, n=1, frequency_penalty=0,
        presence_penalty=0, logit_bias={}, logprobs=False, tools=[], store=False,
        response_format={"type": "text"}, user="someone", extra_body={"min_tokens": 0})

    assert answer.choices[0].finish_reason == "length"


async def test_model_without_chat_template_is_refused_clearly(
    server: RunningServer, sdk: Any
) -> None:
    client, _ = sdk(server)

    with pytest.raises(openai.BadRequestError, match="no chat template"):
        await client.chat.completions.create(model=MODEL, messages=QUESTION)


async def test_template_refusal_is_a_bad_request(chat_server: RunningServer, sdk: Any) -> None:
    client, _ = sdk(chat_server)

    with pytest.raises(openai.BadRequestError, match="cannot open with the assistant"):
        await client.chat.completions.create(
            model=MODEL, messages=[{"role": "assistant", "content": "Hello"}])


async def test_prompt_over_the_context_is_a_bad_request(
    chat_server: RunningServer, sdk: Any
) -> None:
    client, _ = sdk(chat_server)

    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Paris, Rome. " * 200}])

    assert caught.value.code == "prompt_too_long"


async def test_waiting_limit_is_a_rate_limit_with_retry_after(
    start_server: StartServer, sdk: Any
) -> None:
    server = await start_server(max_waiting=1)
    client, _ = sdk(server)
    server.recorder.hold()  # the first request waits for its first token
    first = await client.completions.create(model=MODEL, prompt="Hi", max_tokens=2,
                                            stream=True)

    with pytest.raises(openai.RateLimitError) as caught:
        await client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    server.recorder.release()
    rest = [c async for c in first]

    assert caught.value.code == "too_many_waiting"
    assert int(caught.value.response.headers["retry-after"]) >= 1
    assert "x-should-retry" not in caught.value.response.headers
    assert rest[-1].choices[0].finish_reason == "length"


async def test_failed_engine_is_not_retried_by_the_sdk(
    start_server: StartServer, sdk: Any
) -> None:
    def broken(settings: Settings) -> RecordingEngine:
        raise RuntimeError("no model here")

    server = await start_server(make_engine=broken, wait_ready=False)
    await server.app.runtime.loading_outcome()
    client, tee = sdk(server, max_retries=2)

    with pytest.raises(openai.InternalServerError) as caught:
        await client.completions.create(model=MODEL, prompt="Hi")

    assert caught.value.status_code == 503
    assert caught.value.code == "unavailable"
    assert caught.value.response.headers["x-should-retry"] == "false"
    assert caught.value.response.headers["retry-after"] == "30"
    assert tee.requests == 1  # the SDK obeyed x-should-retry
