"""Tests for app.wire's resumable events: ids ``<request_id>:<n>``, exact bytes.

The expected bytes were recorded from the encoder these replace (``app/resumable.py``'s
``ResumableEncoder`` and its constants at eb506aa); a browser page builds on them.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from app.wire import (
    KEEPALIVE_COMMENT,
    RETRY_LINE,
    RETRY_MS,
    TAKEN_OVER_EVENT,
    NativeEvents,
    ResumableEvents,
)
from engine import FinishEvent, FinishReason, TokenEvent
from streams import ErrorType, SSEParser, StreamError, StreamItem

RID = "req1"


def test_the_events_are_the_native_ones_with_ids_that_name_the_stream() -> None:
    events = ResumableEvents(RID, 5)

    assert events.opening() == (
        b'event: start\nid: req1:1\ndata: {"id":"req1","prompt_tokens":5}\n\n'
    )
    assert events(2, TokenEvent(RID, 0, 100, "Hello")) == (
        b'event: token\nid: req1:2\ndata: {"index":0,"id":100,"text":"Hello"}\n\n'
    )
    assert events(3, TokenEvent(RID, 1, 101, "é\u2028\n")) == (
        b'event: token\nid: req1:3\ndata: {"index":1,"id":101,"text":"\\u00e9\\u2028\\n"}\n\n'
    )
    assert events(4, FinishEvent(RID, FinishReason.STOP, 5, 3, cached_tokens=4)) == (
        b'event: done\nid: req1:4\ndata: {"finish_reason":"stop",'
        b'"usage":{"prompt_tokens":5,"completion_tokens":3,"cached_tokens":4}}\n\n'
    )
    assert events(5, StreamError(ErrorType.RESUME_LOG_FULL, "too many bytes")) == (
        b'event: error\nid: req1:5\ndata: {"error":{"type":"resume_log_full",'
        b'"message":"too many bytes"}}\n\n'
    )


def test_the_pieces_outside_the_stream_carry_no_id() -> None:
    assert RETRY_LINE == b"retry: 1000\n" and RETRY_MS == 1000
    assert TAKEN_OVER_EVENT == (
        b'event: error\ndata: {"error":{"type":"taken_over",'
        b'"message":"another reader took this stream over"}}\n\n'
    )
    assert ResumableEvents(RID, 5).error(
        ErrorType.TAKEN_OVER, "another reader took this stream over") == TAKEN_OVER_EVENT
    assert ResumableEvents(RID, 5).keepalive() == KEEPALIVE_COMMENT


def test_an_event_without_id_leaves_the_clients_last_event_id() -> None:
    events = ResumableEvents(RID, 5)
    parser = SSEParser()

    parser.feed(RETRY_LINE + events.opening() + events.encode([TokenEvent(RID, 0, 1, "a")]))
    parser.feed(TAKEN_OVER_EVENT)

    assert (parser.last_event_id, parser.retry) == ("req1:2", RETRY_MS)


# --- properties -----------------------------------------------------------------------

texts = st.text(max_size=12) | st.sampled_from(["", "\n", "\u2028", '"', "😀"])
items = st.lists(st.one_of(
    st.builds(TokenEvent, st.just(RID), st.integers(0, 10**6), st.integers(0, 2**31), texts),
    st.builds(FinishEvent, st.just(RID),
              st.sampled_from([FinishReason.EOS, FinishReason.LENGTH, FinishReason.STOP]),
              st.integers(0, 10**5), st.integers(0, 10**5)),
    st.builds(StreamError, st.sampled_from(list(ErrorType)), texts),
), max_size=12)


@given(items)
def test_a_batch_encodes_to_the_registrys_numbered_events(batch: list[StreamItem]) -> None:
    """``encode`` numbers on from the opening as the registry does (event 1 the opening,
    each item the next): the same bytes as calling the encoder with each n."""
    together, numbered = ResumableEvents(RID, 5), ResumableEvents(RID, 5)
    together.opening()

    assert together.encode(batch) == b"".join(
        numbered(n, item) for n, item in enumerate(batch, start=2)
    )


@given(items, st.integers(0, 12))
def test_a_batch_is_the_concatenation_of_single_items(batch: list[StreamItem], cut: int) -> None:
    split, one_by_one = ResumableEvents(RID, 5), ResumableEvents(RID, 5)
    split.opening()
    one_by_one.opening()

    assert split.encode(batch[:cut]) + split.encode(batch[cut:]) == b"".join(
        one_by_one.encode([item]) for item in batch
    )


@given(items)
def test_the_data_and_names_are_the_native_events(batch: list[StreamItem]) -> None:
    resumable, native = ResumableEvents(RID, 5), NativeEvents(RID, 5)
    ours = SSEParser().feed(resumable.opening() + resumable.encode(batch))
    theirs = SSEParser().feed(native.opening() + native.encode(batch))

    assert [(e.event, e.data) for e in ours] == [(e.event, e.data) for e in theirs]
    assert [e.id for e in ours] == [f"{RID}:{e.id}" for e in theirs]
