"""A background response's events made again from its log (``app/wire/responses_replay.py``),
without a server: the logged native events read back into the items they were made of,
and the Responses events of a replay equal those encoded live, from any cut."""

from __future__ import annotations

from typing import Any

from app.wire import ResumableEvents
from app.wire.responses_replay import ReplayedEvents, logged_item, replay
from engine import FinishEvent, FinishReason, TokenEvent, TokenLogprobs
from streams import ErrorType, StreamError
from streams.resume import LoggedEvent
from tests.test_wire_responses import decode, encoder

ITEMS: list[Any] = [
    TokenEvent("r", 0, 100, "Par"),
    TokenEvent("r", 1, 101, "is \u2028é", TokenLogprobs("is", -0.5, ((101, "is", -0.5),
                                                                   (7, "x", -2.0)))),
    TokenEvent("r", 2, 102, ""),
    FinishEvent("r", FinishReason.LENGTH, prompt_tokens=4, completion_tokens=3,
                cached_tokens=2),
]


def logged(items: list[Any]) -> list[bytes]:
    """The log of a resumable stream of ``items``: event 1 ``start``, then one each."""
    events = ResumableEvents("r", 4)
    return [events.opening(), *(events(n, item) for n, item in enumerate(items, start=2))]


def test_logged_events_read_back_into_their_items() -> None:
    log = logged([*ITEMS[:3], StreamError(ErrorType.SLOW_CLIENT, "too slow")])

    back = [logged_item(data) for data in log]

    assert back[0] is None  # start
    assert [(t.index, t.token_id, t.text, t.logprobs) for t in back[1:4]] == [  # type: ignore[union-attr]
        (t.index, t.token_id, t.text, t.logprobs) for t in ITEMS[:3]]
    assert back[4] == StreamError(ErrorType.SLOW_CLIENT, "too slow")
    done = logged_item(logged(ITEMS)[-1])
    assert isinstance(done, FinishEvent)
    assert (done.reason, done.prompt_tokens, done.completion_tokens, done.cached_tokens) == (
        FinishReason.LENGTH, 4, 3, 2)


def test_a_replay_is_the_live_encoding_and_a_cut_skips_what_was_read() -> None:
    enc = encoder()
    live = decode(enc.opening() + enc.encode(ITEMS))
    log = logged(ITEMS)

    replayed = decode(replay(encoder(), log))
    resumed = encoder(skip_through=4)
    readers = ReplayedEvents(resumed)
    rest = decode(readers.opening() + readers.encode(
        [LoggedEvent(n, data, None) for n, data in enumerate(log, start=1)]))

    assert replayed == live
    assert rest == live[5:]
    assert [e["sequence_number"] for e in rest] == list(range(5, len(live)))
