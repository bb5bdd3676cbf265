"""Several choices read as one source (``app/routes/choices.py``) by the one SSE body.

Two TokenStreams fed by hand (no hub, no engine), Trio's virtual clock: the body
interleaves the choices' chunks by index, a choice's finish does not end the body (the
last one does, with one ``[DONE]``), a wait cut by the keep-alive's timeout loses no
item, and one choice's error ends them all.
"""

from __future__ import annotations

import json

import trio
import trio.testing

from app.routes.body import EventStreamBody
from app.routes.choices import ChoiceItem, ChoicesSource
from app.wire import COMPLETION, KEEPALIVE_COMMENT, OpenAIChunks
from engine import FinishEvent, FinishReason, TokenEvent
from streams import ErrorType, PolicyName, TokenStream
from streams.policy import Policy
from tests.test_keepalive import Owner

INTERVAL_S = 15.0


def token(rid: str, index: int) -> TokenEvent:
    return TokenEvent(rid, index, 100 + index, f"{rid}{index}")


def finish(rid: str, tokens: int) -> FinishEvent:
    return FinishEvent(rid, FinishReason.LENGTH, 4, tokens)


def envelope(kind: ErrorType, message: str) -> dict[str, object]:
    return {"error": {"message": message, "type": kind.value}}


async def run_body(streams: list[TokenStream], sent: list[bytes]) -> None:
    chunks = OpenAIChunks(COMPLETION, "a", "m", error_envelope=envelope, created=0,
                          choices=[s.request_id for s in streams], include_usage=True)
    body = EventStreamBody[ChoiceItem](ChoicesSource(streams), chunks, keepalive_s=INTERVAL_S)
    async with body as iterated:
        async for chunk in iterated:
            sent.append(chunk)


def events(sent: list[bytes]) -> list[object]:
    """Each data line's JSON (or "[DONE]"), and "keep-alive" for each comment."""
    out: list[object] = []
    for chunk in sent:
        if chunk == KEEPALIVE_COMMENT:
            out.append("keep-alive")
            continue
        for line in chunk.decode().splitlines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def test_choices_interleave_and_the_last_finish_ends_the_body_across_keepalives(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a = TokenStream("a", 4, Policy(PolicyName.UNBOUNDED), Owner())
    b = TokenStream("b", 4, Policy(PolicyName.UNBOUNDED), Owner())
    sent: list[bytes] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_body, [a, b], sent)
        await trio.sleep(1.0)
        a.deliver(token("a", 0))
        await trio.sleep(INTERVAL_S * 1.5)  # a keep-alive: the wait on both is cut
        b.deliver(token("b", 0))
        a.deliver(token("a", 1))
        a.deliver(finish("a", 2))
        await trio.sleep(INTERVAL_S * 1.5)
        b.deliver(token("b", 1))
        b.deliver(finish("b", 2))
        await trio.sleep(INTERVAL_S * 3)
        nursery.cancel_scope.cancel()

    got = events(sent)
    texts = [(e["choices"][0]["index"], e["choices"][0]["text"], e["choices"][0]["finish_reason"])
             for e in got if isinstance(e, dict) and e["choices"]]
    # Within one batch the choices' order is the waiters' (Trio's scheduling): per choice
    # the order is the stream's, and what came later comes later.
    assert [t for t in texts if t[0] == 0] == [(0, "a0", None), (0, "a1", None), (0, "", "length")]
    assert [t for t in texts if t[0] == 1] == [(1, "b0", None), (1, "b1", None), (1, "", "length")]
    assert texts[0] == (0, "a0", None) and texts[-2:] == [(1, "b1", None), (1, "", "length")]
    assert got.count("keep-alive") == 2
    usage = got[-2]
    assert isinstance(usage, dict) and usage["usage"]["completion_tokens"] == 4
    assert got[-1] == "[DONE]" and got.count("[DONE]") == 1


async def test_one_choices_error_ends_every_choice(
    autojump_clock: trio.testing.MockClock,
) -> None:
    owners = [Owner(), Owner()]
    a, b = (TokenStream(rid, 4, Policy(PolicyName.UNBOUNDED), owner)
            for rid, owner in zip("ab", owners, strict=True))
    sent: list[bytes] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_body, [a, b], sent)
        await trio.sleep(1.0)
        a.deliver(token("a", 0))
        await trio.sleep(1.0)
        b.deliver(FinishEvent("b", FinishReason.ERROR, 4, 0, error="boom"))
        await trio.sleep(INTERVAL_S * 2)
        nursery.cancel_scope.cancel()

    got = events(sent)
    assert got[-2] == {"error": {"message": "boom", "type": "engine_error"}}
    assert got[-1] == "[DONE]"
    assert owners[0].calls[:1] == ["cancel"]  # the body closed the other choice's stream
