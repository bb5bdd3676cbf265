"""Tests for streams.sse: the WHATWG event-stream rules, the writer, and their round trip.

Parser cases go through the ``parse`` fixture, which feeds each input three ways (as
h11's ``tr()`` does): whole, byte by byte, and whole followed by trailing unterminated
data that must dispatch nothing more.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
from httpx_sse._decoders import SSEDecoder, SSELineDecoder
from hypothesis import given, settings
from hypothesis import strategies as st

from streams import ServerSentEvent, SSEParser, encode_comment, encode_event

Parse = Callable[[bytes], tuple[list[ServerSentEvent], SSEParser]]

# Fields of a block that never ends, and a line that is not terminated: none of it may
# dispatch or change the stream's last event id. (No retry: the spec applies it at once.)
TRAILING = b"event: late\nid: late\ndata: never dispatched"


def _feed_whole(parser: SSEParser, stream: bytes) -> list[ServerSentEvent]:
    return parser.feed(stream)


def _feed_byte_by_byte(parser: SSEParser, stream: bytes) -> list[ServerSentEvent]:
    events = []
    for i in range(len(stream)):
        events += parser.feed(stream[i : i + 1])
    return events


def _feed_with_trailing_data(parser: SSEParser, stream: bytes) -> list[ServerSentEvent]:
    events = parser.feed(stream)
    state = (parser.last_event_id, parser.retry)
    assert parser.feed(TRAILING) == []
    assert (parser.last_event_id, parser.retry) == state
    return events


@pytest.fixture(
    params=[_feed_whole, _feed_byte_by_byte, _feed_with_trailing_data],
    ids=["whole", "byte_by_byte", "trailing_data"],
)
def parse(request: pytest.FixtureRequest) -> Parse:
    """Feed a stream in one of the three modes, close it, and return events and parser."""
    feed: Callable[[SSEParser, bytes], list[ServerSentEvent]] = request.param

    def run(stream: bytes) -> tuple[list[ServerSentEvent], SSEParser]:
        parser = SSEParser()
        events = feed(parser, stream)
        assert parser.close() == []
        return events, parser

    return run


def _parse_all(stream: bytes, chunks: list[bytes] | None = None) -> tuple[object, ...]:
    parser = SSEParser()
    events = []
    for chunk in chunks if chunks is not None else [stream]:
        events += parser.feed(chunk)
    events += parser.close()
    return events, parser.last_event_id, parser.retry


# --- decoding -------------------------------------------------------------------------


def test_bom_at_start_of_stream_is_dropped(parse: Parse) -> None:
    events, _ = parse(b"\xef\xbb\xbfdata: x\n\n")
    assert events == [ServerSentEvent(data="x")]


def test_only_first_bom_is_dropped(parse: Parse) -> None:
    # The second BOM is part of the field name "\ufeffdata", which is unknown.
    events, _ = parse(b"\xef\xbb\xbf\xef\xbb\xbfdata: x\n\ndata: y\n\n")
    assert events == [ServerSentEvent(data="y")]


def test_multibyte_char_split_across_feeds_is_decoded() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: \xe2\x82") == []
    assert parser.feed(b"\xac \xf0\x9f") == []
    assert parser.feed(b"\x98\x80\n\n") == [ServerSentEvent(data="€ 😀")]


def test_invalid_utf8_becomes_replacement_character(parse: Parse) -> None:
    events, _ = parse(b"data: a\xffb\n\n")
    assert events == [ServerSentEvent(data="a\ufffdb")]


# --- the line layer -------------------------------------------------------------------


@pytest.mark.parametrize("eol", [b"\n", b"\r", b"\r\n"], ids=["lf", "cr", "crlf"])
def test_each_line_ending_ends_a_line(parse: Parse, eol: bytes) -> None:
    events, _ = parse(b"data: a" + eol + b"data: b" + eol + eol)
    assert events == [ServerSentEvent(data="a\nb")]


def test_mixed_line_endings_in_one_stream(parse: Parse) -> None:
    events, _ = parse(b"data: a\r\ndata: b\rdata: c\n\r\n")
    assert events == [ServerSentEvent(data="a\nb\nc")]


def test_cr_ending_one_chunk_and_lf_starting_next_is_one_line_ending() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: a\r") == []
    # Read as two line endings, the LF would be a blank line dispatching "a" alone.
    assert parser.feed(b"\ndata: b\n\n") == [ServerSentEvent(data="a\nb")]


def test_empty_feed_between_cr_and_lf_keeps_them_one_line_ending() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: a\r") == []
    assert parser.feed(b"") == []
    assert parser.feed(b"\ndata: b\r\n\r\n") == [ServerSentEvent(data="a\nb")]


def test_blank_line_ending_in_cr_dispatches_without_waiting_for_lf() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: a\r\r") == [ServerSentEvent(data="a")]


def test_unicode_line_separators_inside_data_are_not_line_breaks(parse: Parse) -> None:
    data = "a\u2028b\u2029c\u0085d\x0be\x0cf\x1cg"  # all split by str.splitlines()
    events, _ = parse(b"data: " + data.encode() + b"\n\n")
    assert events == [ServerSentEvent(data=data)]


# --- fields ---------------------------------------------------------------------------


def test_comment_lines_are_ignored(parse: Parse) -> None:
    events, _ = parse(b": hello\ndata: x\n:\n: data: y\n\n")
    assert events == [ServerSentEvent(data="x")]


def test_field_without_colon_is_name_with_empty_value(parse: Parse) -> None:
    events, _ = parse(b"data\ndata\n\ndata\n\n")
    assert events == [ServerSentEvent(data="\n"), ServerSentEvent(data="")]


def test_one_space_after_colon_is_removed_and_a_second_kept(parse: Parse) -> None:
    events, _ = parse(b"data:x\n\ndata: x\n\ndata:  x\n\n")
    assert [e.data for e in events] == ["x", "x", " x"]


def test_colon_after_the_first_belongs_to_the_value(parse: Parse) -> None:
    events, _ = parse(b"data: a: b:c\n\n")
    assert events == [ServerSentEvent(data="a: b:c")]


def test_unknown_fields_are_ignored(parse: Parse) -> None:
    events, _ = parse(b"foo: bar\nData: no\ndata: x\n\n")
    assert events == [ServerSentEvent(data="x")]


def test_data_lines_are_joined_with_lf(parse: Parse) -> None:
    events, _ = parse(b"data: a\ndata:\ndata: c\n\n")
    assert events == [ServerSentEvent(data="a\n\nc")]


def test_event_field_sets_type(parse: Parse) -> None:
    events, _ = parse(b"event: token\ndata: x\n\n")
    assert events == [ServerSentEvent(event="token", data="x")]


def test_default_event_type_is_message(parse: Parse) -> None:
    events, _ = parse(b"data: x\n\nevent:\ndata: y\n\n")
    assert [e.event for e in events] == ["message", "message"]


def test_event_without_data_dispatches_nothing_and_resets_type(parse: Parse) -> None:
    events, _ = parse(b"event: ping\n\ndata: x\n\n")
    assert events == [ServerSentEvent(event="message", data="x")]


def test_id_containing_nul_is_ignored(parse: Parse) -> None:
    events, parser = parse(b"id: a\ndata: 1\n\nid: b\x00c\ndata: 2\n\n")
    assert [e.id for e in events] == ["a", "a"]
    assert parser.last_event_id == "a"


def test_last_event_id_persists_and_event_without_id_carries_it(parse: Parse) -> None:
    events, parser = parse(b"id: 1\ndata: a\n\ndata: b\n\nid: 2\ndata: c\n\n")
    assert [e.id for e in events] == ["1", "1", "2"]
    assert parser.last_event_id == "2"


def test_empty_id_field_resets_last_event_id(parse: Parse) -> None:
    events, parser = parse(b"id: 1\ndata: a\n\nid\ndata: b\n\n")
    assert [e.id for e in events] == ["1", ""]
    assert parser.last_event_id == ""


def test_id_takes_effect_on_blank_line_even_without_data() -> None:
    parser = SSEParser()
    assert parser.feed(b"id: 7\n") == []
    assert parser.last_event_id == ""
    assert parser.feed(b"\n") == []
    assert parser.last_event_id == "7"


def test_valid_retry_sets_reconnection_time(parse: Parse) -> None:
    events, parser = parse(b"retry: 3000\ndata: a\n\ndata: b\n\n")
    assert [e.retry for e in events] == [3000, None]
    assert parser.retry == 3000


@pytest.mark.parametrize(
    "value",
    [b"12a", b"", b" 12", b"-1", b"1.5", "١٢".encode(), "²".encode(), "１２".encode()],
    ids=["letter", "empty", "extra_space", "negative", "decimal", "arabic", "super", "wide"],
)
def test_retry_with_anything_but_ascii_digits_is_ignored(parse: Parse, value: bytes) -> None:
    events, parser = parse(b"retry: 5\n\nretry: " + value + b"\ndata: x\n\n")
    assert events == [ServerSentEvent(data="x", retry=None)]
    assert parser.retry == 5


# --- dispatch and end of stream -------------------------------------------------------


def test_blank_line_dispatches_event() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: x\n") == []
    assert parser.feed(b"\n") == [ServerSentEvent(data="x")]


def test_several_events_in_one_feed_come_in_order(parse: Parse) -> None:
    events, _ = parse(b"data: 1\n\nevent: e\ndata: 2\n\n\n\ndata: 3\n\n")
    assert events == [
        ServerSentEvent(data="1"),
        ServerSentEvent(event="e", data="2"),
        ServerSentEvent(data="3"),
    ]


def test_unfinished_event_at_end_of_stream_is_discarded(parse: Parse) -> None:
    events, _ = parse(b"data: x\n\ndata: y\n")
    assert events == [ServerSentEvent(data="x")]


def test_unterminated_final_line_is_discarded(parse: Parse) -> None:
    events, _ = parse(b"data: x\n\ndata: y")
    assert events == [ServerSentEvent(data="x")]


def test_close_is_idempotent_and_keeps_stream_state() -> None:
    parser = SSEParser()
    parser.feed(b"id: 3\nretry: 10\ndata: x\n\ndata: y\n")
    assert parser.close() == []
    assert parser.close() == []
    assert (parser.last_event_id, parser.retry) == ("3", 10)


def test_feed_after_close_raises() -> None:
    parser = SSEParser()
    parser.close()
    with pytest.raises(RuntimeError, match="after close"):
        parser.feed(b"data: x\n\n")


# --- the writer -----------------------------------------------------------------------


def test_encode_event_writes_data_and_blank_line() -> None:
    assert encode_event("hi") == b"data: hi\n\n"


def test_encode_event_writes_one_data_line_for_empty_data() -> None:
    assert encode_event("") == b"data: \n\n"


def test_encode_event_splits_multiline_data_at_crlf_cr_and_lf() -> None:
    assert encode_event("a\nb\r\nc\rd\n") == b"data: a\ndata: b\ndata: c\ndata: d\ndata: \n\n"


def test_encode_event_keeps_u2028_inside_one_data_line() -> None:
    assert encode_event("a\u2028b") == "data: a\u2028b\n\n".encode()


def test_encode_event_writes_event_id_retry_then_data() -> None:
    encoded = encode_event("x", event="token", id="42", retry=1500)
    assert encoded == b"event: token\nid: 42\nretry: 1500\ndata: x\n\n"


def test_encode_event_is_utf8_bytes() -> None:
    encoded = encode_event("é€😀", event="ü", id="ñ")
    assert isinstance(encoded, bytes)
    assert encoded == "event: ü\nid: ñ\ndata: é€😀\n\n".encode()


@pytest.mark.parametrize(
    "encode",
    [lambda v: encode_event("x", event=v), lambda v: encode_event("x", id=v)],
    ids=["event", "id"],
)
@pytest.mark.parametrize(
    "value", ["a\nb", "a\rb", "a\r\nb", "\n"], ids=["lf", "cr", "crlf", "only"]
)
def test_encode_event_rejects_line_break_in_event_or_id(
    encode: Callable[[str], bytes], value: str
) -> None:
    with pytest.raises(ValueError, match="CR or LF"):
        encode(value)


def test_encode_event_rejects_nul_in_id() -> None:
    with pytest.raises(ValueError, match="NUL"):
        encode_event("x", id="a\0b")


def test_encode_event_rejects_negative_retry() -> None:
    with pytest.raises(ValueError, match="non-negative"):
        encode_event("x", retry=-1)


def test_encode_event_rejects_bool_retry() -> None:
    with pytest.raises(TypeError, match="bool"):
        encode_event("x", retry=True)


def test_encode_comment_writes_comment_lines_without_a_blank_line() -> None:
    assert encode_comment("keep-alive") == b": keep-alive\n"
    assert encode_comment() == b":\n"


def test_encode_comment_writes_each_line_as_its_own_comment() -> None:
    assert encode_comment("a\r\nb\n") == b": a\n: b\n:\n"


def test_comment_between_events_dispatches_nothing(parse: Parse) -> None:
    stream = encode_event("1", id="a") + encode_comment("x\ndata: y") + encode_event("2")
    events, _ = parse(stream)
    assert events == [ServerSentEvent(data="1", id="a"), ServerSentEvent(data="2", id="a")]


# --- properties -----------------------------------------------------------------------

_FRAGMENTS = st.sampled_from(
    [
        *(b"data", b"event", b"id", b"retry", b":", b" ", b"\r", b"\n", b"\r\n", b"x", b"12"),
        *(b"\x00", b"\xef\xbb\xbf", b"\xe2\x80\xa8", b"\xc3\xa9", b"\xf0\x9f\x98\x80", b"\xff"),
    ]
)
_STREAMS = st.one_of(st.lists(_FRAGMENTS, max_size=40).map(b"".join), st.binary(max_size=60))


@settings(max_examples=200, deadline=None)
@given(stream=_STREAMS, data=st.data())
def test_any_chunking_gives_same_events_as_one_feed(stream: bytes, data: st.DataObject) -> None:
    cuts = sorted(data.draw(st.sets(st.integers(1, max(len(stream) - 1, 1))), label="cuts"))
    bounds = [0, *cuts, len(stream)]
    chunks = [stream[a:b] for a, b in itertools.pairwise(bounds)]
    one_by_one = [stream[i : i + 1] for i in range(len(stream))]
    whole = _parse_all(stream)
    assert _parse_all(stream, chunks) == whole
    assert _parse_all(stream, one_by_one) == whole


_DATA_TEXT = st.text(
    st.one_of(st.sampled_from("\n\r\u2028\u0085 :é€😀\x00"), st.characters(codec="utf-8")),
    max_size=20,
)
_EVENT_SPECS = st.tuples(
    _DATA_TEXT,
    st.none() | st.text(st.characters(codec="utf-8", exclude_characters="\r\n"), max_size=8),
    st.none() | st.text(st.characters(codec="utf-8", exclude_characters="\r\n\0"), max_size=8),
    st.none() | st.integers(0, 10**9),
)


def _normalise_line_endings(text: str) -> str:
    return text.replace("\r\n", "\n").replace("\r", "\n")


@settings(max_examples=150, deadline=None)
@given(specs=st.lists(_EVENT_SPECS, max_size=6))
def test_writer_then_parser_round_trips_events(
    specs: list[tuple[str, str | None, str | None, int | None]],
) -> None:
    stream = b"".join(encode_event(d, event=e, id=i, retry=r) for d, e, i, r in specs)
    expected = []
    last_id = ""
    for data, event, id_, retry in specs:
        last_id = last_id if id_ is None else id_
        expected.append(
            ServerSentEvent(
                event=event or "message",
                data=_normalise_line_endings(data),
                id=last_id,
                retry=retry,
            )
        )
    parser = SSEParser()
    assert parser.feed(stream) == expected
    assert parser.last_event_id == last_id


# --- cross-check with httpx-sse, a second implementation ------------------------------


def _parse_with_httpx_sse(stream: bytes) -> list[tuple[str, str, str, int | None]]:
    lines, decoder = SSELineDecoder(), SSEDecoder()
    events = []
    for line in lines.decode(stream.decode("utf-8")) + lines.flush():
        sse = decoder.decode(line)
        if sse is not None:
            events.append((sse.event, sse.data, sse.id, sse.retry))
    return events


@pytest.mark.parametrize(
    "stream",
    [
        encode_event("hello"),
        encode_event("a\nb\r\nc\rd", event="token", id="1", retry=2500),
        encode_event("x", id="7") + encode_event("y") + encode_event("z", id=""),
        encode_event("é\u2028€ 😀", event="ünïcode") + encode_comment("ping") + encode_event(""),
        encode_event(" leading space", event="e") + encode_event("trailing\n", event="e"),
        encode_event("1", id="1") + encode_comment("keep-alive") + encode_event("2", id="2"),
    ],
    ids=["plain", "all_fields", "id_persists", "unicode_and_comment", "spaces_and_newline",
         "keepalive_after_id"],
)
def test_parser_agrees_with_httpx_sse(stream: bytes) -> None:
    ours = [(e.event, e.data, e.id, e.retry) for e in SSEParser().feed(stream)]
    assert ours == _parse_with_httpx_sse(stream)
    assert ours  # guard against two empty lists agreeing
