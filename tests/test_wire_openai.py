"""Tests for app.wire's OpenAI-compatible chunks and answers: exact bytes, no server.

The expected bytes were recorded from the body these encoders replace
(``app/openai_compat.py``'s ``OpenAIChunksBody`` at eb506aa). The error object is the
routes' (they own the status table), so these tests hand the encoder one that builds it
as the routes do for the failures a stream can end with (all 5xx: ``server_error``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.wire import (
    CHAT,
    COMPLETION,
    DONE,
    KEEPALIVE_COMMENT,
    ChoiceShape,
    OpenAIChunks,
    whole_answer,
)
from engine import FinishEvent, FinishReason, TokenEvent
from streams import ErrorType, SSEParser, StreamError, StreamItem

RID = "req1"
CREATED = 1700000000


def server_error(kind: ErrorType, message: str) -> Mapping[str, Any]:
    return {"error": {"message": message, "type": "server_error", "param": None,
                      "code": kind.value}}


def chunks(shape: ChoiceShape, include_usage: bool = False) -> OpenAIChunks:
    return OpenAIChunks(shape, RID, "m-1", error_envelope=server_error,
                        include_usage=include_usage, created=CREATED)


def token(index: int, text: str) -> TokenEvent:
    return TokenEvent(RID, index, 100 + index, text)


EOS = FinishEvent(RID, FinishReason.EOS, 5, 3)
COMPLETION_HEAD = b'data: {"id":"cmpl-req1","object":"text_completion","created":1700000000,'
CHAT_HEAD = (b'data: {"id":"chatcmpl-req1","object":"chat.completion.chunk",'
             b'"created":1700000000,')


def test_a_completion_stream_is_a_chunk_a_token_then_the_finish_then_done() -> None:
    encoder = chunks(COMPLETION)

    assert encoder.opening() == b""
    assert encoder.encode([token(0, "Hello"), token(1, "é\u2028")]) == (
        COMPLETION_HEAD + b'"model":"m-1","choices":[{"index":0,"text":"Hello",'
        b'"logprobs":null,"finish_reason":null}]}\n\n'
        + COMPLETION_HEAD + b'"model":"m-1","choices":[{"index":0,"text":"\\u00e9\\u2028",'
        b'"logprobs":null,"finish_reason":null}]}\n\n'
    )
    assert encoder.encode([EOS]) == (
        COMPLETION_HEAD + b'"model":"m-1","choices":[{"index":0,"text":"",'
        b'"logprobs":null,"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'
    )


def test_a_chat_stream_with_usage_opens_with_the_role_and_ends_with_the_totals() -> None:
    encoder = chunks(CHAT, include_usage=True)

    assert encoder.opening() == (
        CHAT_HEAD + b'"model":"m-1","choices":[{"index":0,"delta":{"role":"assistant",'
        b'"content":""},"logprobs":null,"finish_reason":null}],"usage":null}\n\n'
    )
    assert encoder.encode([token(0, 'a"\n')]) == (
        CHAT_HEAD + b'"model":"m-1","choices":[{"index":0,"delta":{"content":"a\\"\\n"},'
        b'"logprobs":null,"finish_reason":null}],"usage":null}\n\n'
    )
    assert encoder.encode([EOS]) == (
        CHAT_HEAD + b'"model":"m-1","choices":[{"index":0,"delta":{},"logprobs":null,'
        b'"finish_reason":"stop"}],"usage":null}\n\n'
        + CHAT_HEAD + b'"model":"m-1","choices":[],"usage":{"prompt_tokens":5,'
        b'"completion_tokens":3,"total_tokens":8,'
        b'"prompt_tokens_details":{"cached_tokens":0}}}\n\n'
        b"data: [DONE]\n\n"
    )


@pytest.mark.parametrize(("reason", "shown"), [(FinishReason.EOS, "stop"),
                                               (FinishReason.STOP, "stop"),
                                               (FinishReason.LENGTH, "length")])
def test_the_finish_reason_is_in_openais_vocabulary(reason: FinishReason, shown: str) -> None:
    encoder = chunks(COMPLETION)
    last = SSEParser().feed(encoder.encode([FinishEvent(RID, reason, 5, 3)]))

    assert json.loads(last[0].data)["choices"][0]["finish_reason"] == shown


def test_a_stream_error_is_the_error_object_then_done() -> None:
    encoder = chunks(CHAT)

    assert encoder.encode([StreamError(ErrorType.SLOW_CLIENT, "the reader stayed behind")]) == (
        b'data: {"error":{"message":"the reader stayed behind","type":"server_error",'
        b'"param":null,"code":"slow_client"}}\n\ndata: [DONE]\n\n'
    )


def test_a_farewell_is_the_error_object_then_done() -> None:
    assert chunks(COMPLETION, include_usage=True).error("shutdown", "the server is stopping") == (
        b'data: {"error":{"message":"the server is stopping","type":"server_error",'
        b'"param":null,"code":"shutdown"}}\n\ndata: [DONE]\n\n'
    )


def test_an_error_type_this_server_does_not_know_is_an_internal_error() -> None:
    assert chunks(CHAT).error("no_such_type", "boom") == (
        b'data: {"error":{"message":"boom","type":"server_error","param":null,'
        b'"code":"internal_error"}}\n\ndata: [DONE]\n\n'
    )


def test_the_keepalive_and_done_are_the_shared_comment_and_the_sentinel() -> None:
    assert chunks(CHAT).keepalive() == KEEPALIVE_COMMENT == b": keep-alive\n"
    assert DONE == b"data: [DONE]\n\n"


def test_created_defaults_to_now_in_whole_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("time.time", lambda: 1700000000.9)

    assert OpenAIChunks(CHAT, RID, "m", error_envelope=server_error).created == CREATED


@pytest.mark.parametrize("shape", [COMPLETION, CHAT], ids=["completion", "chat"])
def test_a_whole_answer_has_the_text_finish_reason_and_usage(
    shape: ChoiceShape, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("time.time", lambda: 1700000000.5)

    answer = whole_answer(shape, RID, "m-1", "Hi é",
                          FinishEvent(RID, FinishReason.LENGTH, 5, 2, cached_tokens=4))

    choice: dict[str, Any] = {"index": 0, "text": "Hi é", "logprobs": None,
                              "finish_reason": "length"}
    if shape is CHAT:
        choice = {"index": 0, "message": {"role": "assistant", "content": "Hi é",
                                          "refusal": None},
                  "logprobs": None, "finish_reason": "length"}
    assert answer == {
        "id": ("chatcmpl-" if shape is CHAT else "cmpl-") + RID,
        "object": "chat.completion" if shape is CHAT else "text_completion",
        "created": CREATED,
        "model": "m-1",
        "choices": [choice],
        "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7,
                  "prompt_tokens_details": {"cached_tokens": 4}},
    }


# --- properties -----------------------------------------------------------------------

texts = st.text(max_size=12) | st.sampled_from(["", "\n", "\r", "\u2028", '"', "\\", "😀"])
items = st.lists(st.one_of(
    st.builds(TokenEvent, st.just(RID), st.integers(0, 10**6), st.integers(0, 2**31), texts),
    st.builds(FinishEvent, st.just(RID),
              st.sampled_from([FinishReason.EOS, FinishReason.LENGTH, FinishReason.STOP]),
              st.integers(0, 10**5), st.integers(0, 10**5)),
    st.builds(StreamError, st.sampled_from(list(ErrorType)), texts),
), max_size=12)
shapes = st.sampled_from([COMPLETION, CHAT])


@given(shapes, st.booleans(), items)
def test_a_batch_encodes_to_its_items_encoded_one_at_a_time(
    shape: ChoiceShape, include_usage: bool, batch: list[StreamItem]
) -> None:
    together, one_by_one = chunks(shape, include_usage), chunks(shape, include_usage)

    assert together.encode(batch) == b"".join(one_by_one.encode([item]) for item in batch)


@given(shapes, st.booleans(), items)
def test_every_block_is_data_alone_and_json_or_done(
    shape: ChoiceShape, include_usage: bool, batch: list[StreamItem]
) -> None:
    encoder = chunks(shape, include_usage)
    wire = encoder.opening() + encoder.encode(batch) + encoder.keepalive()

    for event in SSEParser().feed(wire):
        assert (event.event, event.id, event.retry) == ("message", "", None)
        if event.data != "[DONE]":
            json.loads(event.data)
    assert b"\nevent:" not in wire and b"\nid:" not in wire and wire.isascii()
