"""Issue 45 item 4: the sampling parameters clients send, over real HTTP.

``logit_bias``, ``presence_penalty``, ``frequency_penalty`` and vLLM's
``repetition_penalty`` through the official ``openai`` SDK and on the native route: each
answer is the engine's own for those parameters (the route maps every field), and a bad
value is a 400 naming its field before the first byte.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import openai
import pytest

from app.settings import Settings
from engine import FinishReason, GenerationRequest, SamplingParams, TokenEvent
from engine.engine import Engine
from engine.model import LoadedModel
from tests import test_openai_sdk
from tests.http_server import TEST_SETTINGS, RecordingEngine, RunningServer, StartServer
from tests.test_openai_sdk import CHATML, MODEL, QUESTION, with_chat_template

chat_server = test_openai_sdk.chat_server  # the fixtures: a ChatML tiny model, the SDK client
sdk = test_openai_sdk.sdk

PROMPT = "0123 0123 0123"
PENALISED: dict[str, Any] = {"frequency_penalty": 1.5, "presence_penalty": 0.5,
                             "repetition_penalty": 1.3}


def engine_ids(loaded: LoadedModel, prompt: str, tokens: int, params: SamplingParams) -> list[int]:
    """The token ids an engine of its own gives ``prompt`` with ``params``."""
    engine = Engine(loaded, max_batch=1, num_blocks=64, block_size=16)
    engine.submit(GenerationRequest("solo", prompt, tokens, sampling=params))
    ids = []
    while engine.has_work():
        ids += [e.token_id for e in engine.step() if isinstance(e, TokenEvent)]
    return ids


async def test_completions_penalties_answer_as_the_engine_does(
    server: RunningServer, sdk: Any, tiny_model: Callable[[str], LoadedModel]
) -> None:
    client, _ = sdk(server)
    loaded = tiny_model(MODEL)

    async def answer(**fields: Any) -> str:
        done = await client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16,
                                               temperature=0, extra_body={
                                                   "ignore_eos": True, **fields})
        return done.choices[0].text

    penalised = await answer(frequency_penalty=1.5, presence_penalty=0.5,
                             repetition_penalty=1.3)
    expected = engine_ids(loaded, PROMPT, 16, SamplingParams(ignore_eos=True, **PENALISED))

    assert penalised == loaded.tokenizer.decode(expected)
    assert penalised != await answer()  # the penalties changed the answer


async def test_chat_logit_bias_makes_its_token_the_whole_greedy_answer(
    chat_server: RunningServer, sdk: Any, tiny_model: Callable[[str], LoadedModel]
) -> None:
    client, _ = sdk(chat_server)

    answer = await client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=5, temperature=0,
        logit_bias={"42": 100, "7": -100})

    assert answer.choices[0].message.content == tiny_model(MODEL).tokenizer.decode([42] * 5)
    assert answer.usage is not None and answer.usage.completion_tokens == 5


@pytest.mark.parametrize("stream", [False, True])
async def test_a_logit_bias_token_outside_the_vocabulary_is_a_400_naming_it(
    chat_server: RunningServer, sdk: Any, stream: bool
) -> None:
    client, _ = sdk(chat_server)

    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(model=MODEL, messages=QUESTION, stream=stream,
                                             logit_bias={"1": 2, "99999999": 5})

    assert caught.value.param == "logit_bias"
    assert "99999999" in caught.value.message
    assert chat_server.recorder.submitted == []


async def test_native_generate_takes_the_penalties(
    server: RunningServer, tiny_model: Callable[[str], LoadedModel]
) -> None:
    body = {"prompt": PROMPT, "max_new_tokens": 16, "ignore_eos": True,
            "logit_bias": {"3": 1.5}, **PENALISED}
    async with server.client() as client:
        response = await client.post("/v1/generate", json=body)
        refused = await client.post("/v1/generate", json={**body, "repetition_penalty": 0})

    params = SamplingParams(ignore_eos=True, logit_bias=((3, 1.5),), **PENALISED)
    assert response.status_code == 200, response.text
    assert response.json()["tokens"] == engine_ids(tiny_model(MODEL), PROMPT, 16, params)
    assert refused.status_code == 422 and "repetition_penalty" in refused.text


# -- n: several choices ---------------------------------------------------------------------


def streamed_texts(chunks: list[Any]) -> dict[int, str]:
    """Each choice's text from a stream's chunks, by index."""
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            delta = getattr(choice, "delta", None)
            text = (delta.content if delta is not None else choice.text) or ""
            texts[choice.index] = texts.get(choice.index, "") + text
    return texts


async def test_n_3_gives_three_greedy_choices_all_the_same(
    chat_server: RunningServer, sdk: Any
) -> None:
    client, _ = sdk(chat_server)

    answer = await client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=6, temperature=0, n=3,
        extra_body={"ignore_eos": True})
    one = await client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=6, temperature=0,
        extra_body={"ignore_eos": True})

    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert {c.message.content for c in answer.choices} == {one.choices[0].message.content}
    assert [c.finish_reason for c in answer.choices] == ["length"] * 3
    assert answer.usage is not None and one.usage is not None
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (
        one.usage.prompt_tokens, 18)


async def test_seeded_n_streams_its_choices_interleaved_as_the_whole_answer_has_them(
    chat_server: RunningServer, sdk: Any
) -> None:
    client, _ = sdk(chat_server)
    fields: dict[str, Any] = {"model": MODEL, "messages": QUESTION, "max_tokens": 8,
                              "temperature": 1.0, "seed": 1234, "extra_body": {"ignore_eos": True}}

    whole = await client.chat.completions.create(**fields, n=3)
    chunks = [c async for c in await client.chat.completions.create(
        **fields, n=3, stream=True, stream_options={"include_usage": True})]
    alone = await client.chat.completions.create(**fields)

    texts = [c.message.content for c in whole.choices]
    assert streamed_texts(chunks) == dict(enumerate(texts))
    assert texts[0] == alone.choices[0].message.content  # choice 0 is the seed's own answer
    assert len(set(texts)) == 3  # seed + i: three different draws
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role]
    finishes = sorted(c.choices[0].index for c in chunks
                      if c.choices and c.choices[0].finish_reason == "length")
    assert roles == [0, 1, 2] and finishes == [0, 1, 2]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 24
    assert len({c.id for c in chunks}) == 1


async def test_completions_n_streams_each_choice_by_its_index(
    server: RunningServer, sdk: Any
) -> None:
    client, _ = sdk(server)
    fields: dict[str, Any] = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5,
                              "temperature": 0.9, "seed": 7, "n": 2,
                              "extra_body": {"ignore_eos": True}}

    whole = await client.completions.create(**fields)
    chunks = [c async for c in await client.completions.create(**fields, stream=True)]

    assert streamed_texts(chunks) == {c.index: c.text for c in whole.choices}
    assert [c.index for c in whole.choices] == [0, 1]


async def test_the_later_choices_find_the_prompt_in_the_prefix_cache(
    start_server: StartServer, tiny_model: Callable[[str], LoadedModel], sdk: Any
) -> None:
    loaded = with_chat_template(tiny_model(MODEL))

    def make_engine(s: Settings) -> RecordingEngine:
        return RecordingEngine(Engine(loaded, max_batch=s.max_batch, num_blocks=s.cache_blocks,
                                      block_size=s.block_size, prefix_cache=True))

    server = await start_server(make_engine=make_engine)
    client, _ = sdk(server)
    messages = [{"role": "system", "content": "Answer in one word, and never more. " * 4},
                {"role": "user", "content": "Name a colour."}]

    answer = await client.chat.completions.create(model=MODEL, messages=messages, n=3,
                                                  max_tokens=2, temperature=0)

    assert answer.usage is not None
    prompt = answer.usage.prompt_tokens
    block = TEST_SETTINGS.block_size
    shared = (prompt - 1) // block * block  # full blocks, never the last position
    assert shared > 0
    assert server.recorder.statistics().prefix_cache_hits == 2 * shared


@pytest.mark.parametrize("n", [0, 9])
async def test_n_out_of_range_is_a_400_naming_it(
    chat_server: RunningServer, sdk: Any, n: int
) -> None:
    client, _ = sdk(chat_server)

    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(model=MODEL, messages=QUESTION, n=n)

    assert caught.value.param == "n"
    assert chat_server.recorder.submitted == []


async def test_a_client_gone_from_an_n_stream_cancels_every_choice(
    chat_server: RunningServer, sdk: Any
) -> None:
    client, _ = sdk(chat_server)
    stream = await client.chat.completions.create(
        model=MODEL, messages=QUESTION, n=3, max_tokens=400, temperature=0, stream=True,
        extra_body={"ignore_eos": True})
    seen = 0
    async for chunk in stream:
        seen += bool(chunk.choices and chunk.choices[0].delta.content is not None)
        if seen == 6:
            break
    await stream.close()

    ids = list(chat_server.recorder.submitted)
    finishes = [await chat_server.wait_finished(rid) for rid in ids]
    assert len(ids) == 3
    assert [f.reason for f in finishes] == [FinishReason.CANCELLED] * 3
    await chat_server.assert_settled()


# -- reasoning_effort ------------------------------------------------------------------------


async def test_reasoning_effort_is_accepted_and_changes_nothing_where_the_template_ignores_it(
    chat_server: RunningServer, sdk: Any
) -> None:
    client, _ = sdk(chat_server)
    fields: dict[str, Any] = {"model": MODEL, "messages": QUESTION, "max_tokens": 6,
                              "temperature": 0}

    plain = await client.chat.completions.create(**fields)
    effort = await client.chat.completions.create(**fields, reasoning_effort="low")

    assert effort.choices[0].message.content == plain.choices[0].message.content


async def test_reasoning_effort_is_refused_where_the_template_reads_it(
    start_server: StartServer, tiny_model: Callable[[str], LoadedModel], sdk: Any
) -> None:
    reading = ("{% if reasoning_effort %}Reasoning: {{ reasoning_effort }}\n{% endif %}"
               + CHATML)
    loaded = with_chat_template(tiny_model(MODEL), reading)

    def make_engine(s: Settings) -> RecordingEngine:
        return RecordingEngine(Engine(loaded, max_batch=s.max_batch, num_blocks=s.cache_blocks,
                                      block_size=s.block_size))

    server = await start_server(make_engine=make_engine)
    client, _ = sdk(server)

    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(model=MODEL, messages=QUESTION,
                                             reasoning_effort="high")
    answer = await client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2)

    assert caught.value.param == "reasoning_effort"
    assert server.recorder.submitted == [answer.id.removeprefix("chatcmpl-")]


async def test_an_unknown_reasoning_effort_is_a_400_naming_it(
    chat_server: RunningServer, sdk: Any
) -> None:
    client, _ = sdk(chat_server)

    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(model=MODEL, messages=QUESTION,
                                             extra_body={"reasoning_effort": "extreme"})

    assert caught.value.param == "reasoning_effort"


async def test_choices_over_the_waiting_limit_are_refused_and_the_opened_ones_closed(
    start_server: StartServer, sdk: Any
) -> None:
    server = await start_server(max_waiting=2)
    server.recorder.hold()  # the choices stay waiting for their first token
    client, _ = sdk(server)

    with pytest.raises(openai.RateLimitError) as caught:
        await client.completions.create(model=MODEL, prompt=PROMPT, n=3, max_tokens=2)

    assert caught.value.code == "too_many_waiting"
    stats = server.hub.statistics()
    assert (stats.opened, stats.refused_waiting) == (2, 1)
    await server.assert_settled()  # the two opened were closed, their blocks back


@pytest.mark.parametrize(("fields", "param"), [
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),  # OpenAI's 300 at most
    ({"logit_bias": {"12": "high"}}, "logit_bias"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"presence_penalty": True}, "presence_penalty"),
])
async def test_penalties_out_of_range_are_400s_naming_them(
    server: RunningServer, sdk: Any, fields: dict[str, Any], param: str
) -> None:
    client, _ = sdk(server)

    with pytest.raises(openai.BadRequestError) as caught:
        await client.completions.create(model=MODEL, prompt=PROMPT, extra_body=fields)

    assert caught.value.param == param
    assert server.recorder.submitted == []
