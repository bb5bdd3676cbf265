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

from engine import GenerationRequest, SamplingParams, TokenEvent
from engine.engine import Engine
from engine.model import LoadedModel
from tests import test_openai_sdk
from tests.http_server import RunningServer
from tests.test_openai_sdk import MODEL, QUESTION

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
