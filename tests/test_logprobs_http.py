"""Log-probabilities over real HTTP: the official ``openai`` SDK against the OpenAI routes
(chat ``logprobs``/``top_logprobs``, completions ``logprobs``), and the native routes'
``token`` events and ``/v1/generate``; streamed equal to whole, top lists sorted and
bounded, out-of-range values refused before any stream (400 on OpenAI's routes, 422 on
ours) with nothing submitted.

A streamed and a whole answer of the same greedy (or seeded) request give the same
tokens, and log-probabilities within the engine tests' tolerance (``LOGPROB_TOLERANCE``:
the same request run twice may meet a cache in another state).
"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from tests.http_clients import parse_sse
from tests.http_server import RunningServer
from tests.test_engine_logprobs import LOGPROB_TOLERANCE
from tests.test_openai_sdk import MODEL, QUESTION, chat_server, sdk  # noqa: F401

CHAT_FIELDS: dict[str, Any] = {"model": "tiny", "messages": QUESTION, "max_tokens": 6,
                               "temperature": 0, "logprobs": True, "top_logprobs": 5}
PROMPT = "The capital of France is"


def assert_same_entries(got: Any, expected: Any) -> None:
    """Chat entries: the same tokens and bytes, the values within the tolerance."""
    assert [(e.token, e.bytes) for e in got] == [(e.token, e.bytes) for e in expected]
    for mine, theirs in zip(got, expected, strict=True):
        assert abs(mine.logprob - theirs.logprob) <= LOGPROB_TOLERANCE
        assert len(mine.top_logprobs) == len(theirs.top_logprobs)
        for a, b in zip(mine.top_logprobs, theirs.top_logprobs, strict=True):
            assert abs(a.logprob - b.logprob) <= LOGPROB_TOLERANCE


def assert_close(got: list[Any], expected: list[Any]) -> None:
    """Completion lists: equal, numbers within the tolerance (dicts by key)."""
    assert len(got) == len(expected)
    for a, b in zip(got, expected, strict=True):
        if isinstance(a, dict):
            assert set(a) == set(b)
            assert all(abs(a[k] - b[k]) <= LOGPROB_TOLERANCE for k in a)
        elif isinstance(a, float):
            assert abs(a - b) <= LOGPROB_TOLERANCE
        else:
            assert a == b


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "seed": 3}],
                         ids=["greedy", "seeded"])
async def test_chat_logprobs_streamed_equal_whole_sorted_and_bounded(
    chat_server: RunningServer, sdk: Any, sampling: dict[str, Any]  # noqa: F811
) -> None:
    client, _ = sdk(chat_server)
    fields = {**CHAT_FIELDS, **sampling}

    whole = await client.chat.completions.create(**fields)
    chunks = [c async for c in await client.chat.completions.create(**fields, stream=True)]

    assert whole.choices[0].logprobs is not None
    content = whole.choices[0].logprobs.content or []
    assert whole.usage is not None and len(content) == whole.usage.completion_tokens == 6
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content or []]
    assert_same_entries(streamed, content)
    for entry in content:
        values = [t.logprob for t in entry.top_logprobs]
        assert len(values) == 5 and values == sorted(values, reverse=True)
        assert entry.bytes == list(entry.token.encode())
        assert entry.logprob <= values[0] <= 0
    if not sampling:  # greedy: each token is the likeliest
        assert all(e.token == e.top_logprobs[0].token for e in content)


async def test_the_sdks_stream_helper_gathers_the_logprobs_of_the_whole_answer(
    chat_server: RunningServer, sdk: Any  # noqa: F811
) -> None:
    client, _ = sdk(chat_server)
    text = (await client.chat.completions.create(**CHAT_FIELDS)).choices[0].message.content
    assert text is not None and len(text) >= 5
    fields = {**CHAT_FIELDS, "stop": text[3:5]}  # the helper refuses a "length" finish
    whole = await client.chat.completions.create(**fields)

    async with client.chat.completions.stream(**fields) as stream:
        final = await stream.get_final_completion()

    assert whole.choices[0].logprobs is not None and final.choices[0].logprobs is not None
    assert_same_entries(final.choices[0].logprobs.content, whole.choices[0].logprobs.content)


async def test_chat_top_logprobs_twenty_and_zero(chat_server: RunningServer, sdk: Any  # noqa: F811
                                                 ) -> None:
    client, _ = sdk(chat_server)

    twenty = await client.chat.completions.create(**{**CHAT_FIELDS, "top_logprobs": 20})
    none = await client.chat.completions.create(**{**CHAT_FIELDS, "top_logprobs": 0})
    plain = await client.chat.completions.create(**{**CHAT_FIELDS, "logprobs": False,
                                                    "top_logprobs": None})

    assert twenty.choices[0].logprobs is not None and none.choices[0].logprobs is not None
    assert {len(e.top_logprobs) for e in twenty.choices[0].logprobs.content or []} == {20}
    assert {len(e.top_logprobs) for e in none.choices[0].logprobs.content or []} == {0}
    assert plain.choices[0].logprobs is None
    assert twenty.choices[0].message.content == plain.choices[0].message.content


async def test_completion_logprobs_streamed_equal_whole_with_offsets(
    chat_server: RunningServer, sdk: Any  # noqa: F811
) -> None:
    client, _ = sdk(chat_server)
    fields: dict[str, Any] = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6,
                              "temperature": 0, "logprobs": 5}

    whole = await client.completions.create(**fields)
    chunks = [c async for c in await client.completions.create(**fields, stream=True)]

    logprobs = whole.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    assert len(logprobs.tokens) == 6
    parts = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert_close([v for p in parts for v in getattr(p, key)], getattr(logprobs, key))
    texts = [c.choices[0].text for c in chunks if c.choices[0].logprobs]
    assert logprobs.text_offset == [len("".join(texts[:i])) for i in range(len(texts))]
    for chosen, value, top in zip(logprobs.tokens, logprobs.token_logprobs or [],
                                  logprobs.top_logprobs or [], strict=True):
        # The likeliest 5 and the chosen, keyed by text: tokens that decode to the same
        # text alone (parts of characters, U+FFFD) share one key, the likelier's.
        assert 1 <= len(top) <= 6 and top[chosen] >= value


@pytest.mark.parametrize(("route", "fields", "param"), [
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),  # without logprobs
    ("chat", {"logprobs": True, "top_logprobs": 2.5}, "top_logprobs"),
    ("completions", {"logprobs": 6}, "logprobs"),
    ("completions", {"logprobs": -1}, "logprobs"),
    ("completions", {"logprobs": True}, "logprobs"),
])
async def test_out_of_range_logprobs_are_bad_requests_before_any_stream(
    chat_server: RunningServer, sdk: Any, route: str, fields: dict[str, Any],  # noqa: F811
    param: str,
) -> None:
    client, _ = sdk(chat_server)

    with pytest.raises(openai.BadRequestError) as caught:
        if route == "chat":
            await client.chat.completions.create(model=MODEL, messages=QUESTION, stream=True,
                                                 **fields)
        else:
            await client.completions.create(model=MODEL, prompt=PROMPT, stream=True, **fields)

    assert (caught.value.status_code, caught.value.param) == (400, param)
    assert chat_server.recorder.submitted == []


# -- the native routes ----------------------------------------------------------------


async def test_native_token_events_carry_logprobs_as_generate_answers_them(
    server: RunningServer,
) -> None:
    body = {"prompt": PROMPT, "max_new_tokens": 5, "ignore_eos": True, "logprobs": True,
            "top_logprobs": 3}
    async with server.client() as client:
        streamed = parse_sse((await client.post("/v1/stream", json=body)).content)
        whole = (await client.post("/v1/generate", json=body)).json()
        plain = parse_sse((await client.post("/v1/stream", json={**body, "logprobs": False,
                                                                  "top_logprobs": 0})).content)

    tokens = [json.loads(e.data) for e in streamed if e.event == "token"]
    assert [t["id"] for t in tokens] == whole["tokens"]
    assert [t["logprobs"]["token"] for t in tokens] == [e["token"] for e in whole["logprobs"]]
    assert_close([t["logprobs"]["logprob"] for t in tokens],
                 [e["logprob"] for e in whole["logprobs"]])
    assert [len(t["logprobs"]["top"]) for t in tokens] == [len(e["top"]) for e in whole["logprobs"]]
    for token in tokens:
        top = token["logprobs"]["top"]
        assert len(top) == 3 and [t["logprob"] for t in top] == sorted(
            (t["logprob"] for t in top), reverse=True)
        assert top[0]["id"] == token["id"]  # greedy: the likeliest
    assert all("logprobs" not in json.loads(e.data) for e in plain if e.event == "token")


@pytest.mark.parametrize("fields", [{"logprobs": True, "top_logprobs": 21},
                                    {"top_logprobs": 1}, {"logprobs": "yes"}])
async def test_native_out_of_range_logprobs_are_refused_before_the_stream(
    server: RunningServer, fields: dict[str, Any]
) -> None:
    async with server.client() as client:
        response = await client.post("/v1/stream", json={"prompt": PROMPT, **fields})

    assert response.status_code == 422
    assert response.headers["content-type"].startswith("application/json")
    assert server.recorder.submitted == []
