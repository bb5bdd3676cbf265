"""Tests for app.wire's native events (``/v1/stream``): exact bytes, no server.

The expected bytes were recorded from the body these encoders replace
(``app/sse_body.py``'s ``EventStreamBody`` at eb506aa): a client sees the same stream.
"""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from app.wire import (
    KEEPALIVE_COMMENT,
    NativeEvents,
    encode_json_event,
    item_event,
    token_event,
)
from engine import FinishEvent, FinishReason, TokenEvent
from streams import ErrorType, SSEParser, StreamError, StreamItem

RID = "req1"
# JSON's escapes, a character outside ASCII, U+2028 (a line break to str.splitlines) and
# one outside the BMP (a surrogate pair in JSON).
AWKWARD = ', w"o\\rld\n'
WIDE = "é✓\u2028😀"


def token(index: int, text: str) -> TokenEvent:
    return TokenEvent(RID, index, 100 + index, text)


def finish(reason: FinishReason, completion_tokens: int = 3) -> FinishEvent:
    return FinishEvent(RID, reason, 5, completion_tokens, cached_tokens=4)


START = b'event: start\nid: 1\ndata: {"id":"req1","prompt_tokens":5}\n\n'


def test_a_stream_is_start_then_a_token_event_each_then_done() -> None:
    events = NativeEvents(RID, 5)

    chunks = [
        events.opening(),
        events.encode([token(0, "Hello")]),
        events.encode([token(1, AWKWARD), token(2, WIDE)]),
        events.encode([finish(FinishReason.EOS)]),
    ]

    assert chunks == [
        START,
        b'event: token\nid: 2\ndata: {"index":0,"id":100,"text":"Hello"}\n\n',
        b'event: token\nid: 3\ndata: {"index":1,"id":101,"text":", w\\"o\\\\rld\\n"}\n\n'
        b'event: token\nid: 4\ndata: {"index":2,"id":102,'
        b'"text":"\\u00e9\\u2713\\u2028\\ud83d\\ude00"}\n\n',
        b'event: done\nid: 5\ndata: {"finish_reason":"eos",'
        b'"usage":{"prompt_tokens":5,"completion_tokens":3,"cached_tokens":4}}\n\n',
    ]


def test_every_finish_reason_is_its_own_value() -> None:
    for reason in (FinishReason.LENGTH, FinishReason.STOP):
        events = NativeEvents(RID, 5)
        events.opening()

        assert events.encode([token(0, ""), finish(reason, 1)]) == (
            b'event: token\nid: 2\ndata: {"index":0,"id":100,"text":""}\n\n'
            b'event: done\nid: 3\ndata: {"finish_reason":"' + reason.value.encode()
            + b'","usage":{"prompt_tokens":5,"completion_tokens":1,"cached_tokens":4}}\n\n'
        )


def test_a_stream_error_is_an_error_event_with_the_next_id() -> None:
    events = NativeEvents(RID, 5)
    events.opening()

    assert events.encode([StreamError(ErrorType.SLOW_CLIENT, "the reader stayed behind")]) == (
        b'event: error\nid: 2\ndata: {"error":{"type":"slow_client",'
        b'"message":"the reader stayed behind"}}\n\n'
    )


def test_a_farewell_is_an_error_event_numbered_after_the_last() -> None:
    events = NativeEvents(RID, 5)
    events.opening()
    events.encode([token(0, "a")])

    assert events.error(ErrorType.SHUTDOWN, "the server is stopping") == (
        b'event: error\nid: 3\ndata: {"error":{"type":"shutdown",'
        b'"message":"the server is stopping"}}\n\n'
    )


def test_the_keepalive_is_a_comment_that_dispatches_nothing() -> None:
    events = NativeEvents(RID, 5)
    parser = SSEParser()

    assert events.keepalive() == KEEPALIVE_COMMENT == b": keep-alive\n"
    assert parser.feed(START + events.keepalive()) != []
    assert parser.feed(events.keepalive() * 3) == []


# --- properties -----------------------------------------------------------------------

texts = st.text(alphabet=st.characters(codec="utf-8"), max_size=12) | st.sampled_from(
    ["", "\n", "\r\n", "\u2028", "\u0085", '"', "\\", "\x00", "😀", "\ud800"]
)
tokens = st.builds(TokenEvent, st.just(RID), st.integers(0, 10**6), st.integers(0, 2**31),
                   texts)
finishes = st.builds(FinishEvent, st.just(RID),
                     st.sampled_from([FinishReason.EOS, FinishReason.LENGTH, FinishReason.STOP]),
                     st.integers(0, 10**5), st.integers(0, 10**5))
errors = st.builds(StreamError, st.sampled_from(list(ErrorType)), texts)
items = st.lists(st.one_of(tokens, finishes, errors), max_size=12)


@given(st.integers(1, 10**9), tokens)
def test_the_hand_built_token_event_is_the_general_encoding_byte_for_byte(
    event_id: int, item: TokenEvent
) -> None:
    assert token_event(event_id, item) == encode_json_event("token", event_id,
                                                           item_event(item)[1])


@given(items)
def test_a_batch_encodes_to_its_items_encoded_one_at_a_time(batch: list[StreamItem]) -> None:
    together, one_by_one = NativeEvents(RID, 5), NativeEvents(RID, 5)
    together.opening()
    one_by_one.opening()

    assert together.encode(batch) == b"".join(one_by_one.encode([item]) for item in batch)


@given(items)
def test_the_fast_path_equals_the_general_path_in_a_stream(batch: list[StreamItem]) -> None:
    events = NativeEvents(RID, 5)
    expected = [encode_json_event("start", 1, {"id": RID, "prompt_tokens": 5})]
    for n, item in enumerate(batch, start=2):
        name, data = item_event(item)
        expected.append(encode_json_event(name, n, data))

    assert events.opening() + events.encode(batch) == b"".join(expected)


@given(items)
def test_a_parser_reads_back_every_event_with_its_id_and_data(batch: list[StreamItem]) -> None:
    events = NativeEvents(RID, 5)
    wire = events.opening() + events.encode(batch) + events.keepalive()

    parsed = SSEParser().feed(wire)

    assert [(e.event, e.id) for e in parsed] == [
        ("start", "1"), *((item_event(item)[0], str(n)) for n, item in enumerate(batch, 2))
    ]
    assert [json.loads(e.data) for e in parsed[1:]] == [
        json.loads(json.dumps(item_event(item)[1])) for item in batch
    ]
    assert wire.isascii()
