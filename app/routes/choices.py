"""Several choices of one OpenAI request (``n``): a stream each, read as one.

Each choice is a request of its own to the engine (its own id, its own generator): the
first is the request as prepared, choice ``i`` the same prompt's ids with a seed of
``seed + i`` when the request has a seed (so that a seeded answer is reproducible and
its first choice is the answer ``n: 1`` gives), else its own random one; greedy choices
are all the same answer, as OpenAI's and vLLM's are. They are submitted back to back,
so that the prefix cache serves the prompt's full blocks to all but the first:
admission holds a sequence whose first block to compute is one a running prefill is
computing (``engine.prefix_cache``: ``waits_for``) until that block is committed, and
then shares it.

``ChoicesSource`` reads the n streams as one source for the SSE body and for a whole
answer: every item each stream has queued, a choice's finish while others go on as a
``ChoiceFinish``, and the last finish as itself (the body's terminal item). A stream's
error ends them all (the body closes the source: every stream). Its waits are a nursery
of one ``receive_batch`` per open stream, the first to get items cancelling the others:
``receive_batch`` loses nothing when cancelled, and what a waiter took is kept in the
source before anything can cancel its caller, so a cancel (the keep-alive's timeout,
the client gone) loses no item either.
"""

from __future__ import annotations

import uuid
from dataclasses import replace

import trio

from engine import MAX_SEED, FinishEvent, GenerationRequest, SamplingParams, TokenEvent
from streams import StreamError, StreamItem, TokenStream

from ..auth import owned_request
from ..errors import ApiError
from ..metrics import RequestTimer
from ..runtime import Prepared
from ..wire import ChoiceFinish

ChoiceItem = StreamItem | ChoiceFinish


def choice_sampling(sampling: SamplingParams, index: int) -> SamplingParams:
    """Choice ``index``'s sampling: ``seed + index`` (wrapped within the seeds'
    range) when seeded, else the request's own."""
    if sampling.seed is None or index == 0:
        return sampling
    return replace(sampling, seed=(sampling.seed + index) % (MAX_SEED + 1))


def choices_prepared(prepared: Prepared, generation: GenerationRequest, n: int
                     ) -> list[Prepared]:
    """``prepared`` (choice 0) and ``n - 1`` more of its prompt's ids, each under an id
    of its own that the request's key owns (``generation``: the request before
    ``owned_request``, whose namespace it derives again the same)."""
    more = []
    for index in range(1, n):
        owned = owned_request(replace(generation, request_id=uuid.uuid4().hex))
        request = replace(prepared.request, request_id=owned.request_id,
                          sampling=choice_sampling(prepared.request.sampling, index))
        more.append(replace(prepared, request=request))
    return [prepared, *more]


class ChoicesSource:
    """n streams as one ``ItemSource`` (the module docstring); it owns none of them
    (the connection does), but ``close`` closes them all."""

    def __init__(self, streams: list[TokenStream]) -> None:
        self.streams = streams
        self._open = list(streams)  # not ended
        self._taken: list[ChoiceItem] = []  # taken by a waiter, not yet returned
        self._ended: BaseException | None = None  # a stream's EndOfChannel or close

    def take_ready(self, max_items: int) -> list[ChoiceItem]:
        """What is taken or queued now, at most ``max_items``. Sync, no checkpoint."""
        items, self._taken = self._taken[:max_items], self._taken[max_items:]
        for stream in list(self._open):
            if len(items) >= max_items:
                break
            items += self._relabel(stream, stream.take_ready(max_items - len(items)))
        return items

    async def receive_batch(self, max_items: int) -> list[ChoiceItem]:
        """At least one item (the terminal one last). Raises trio.EndOfChannel after
        the last, trio.ClosedResourceError once closed. Cancellation: nothing to undo:
        an item leaves its stream only in the synchronous stretch that returns it."""
        await trio.lowlevel.checkpoint()
        ready = self.take_ready(max_items)
        if ready:
            return ready
        if self._ended is not None or not self._open:
            raise self._ended or trio.EndOfChannel()
        try:
            async with trio.open_nursery() as nursery:
                for stream in self._open:
                    nursery.start_soon(self._wait, stream, max_items, nursery.cancel_scope)
        except BaseExceptionGroup as group:  # only Cancelled: the waiters catch the rest
            raise group.exceptions[0] from None
        ready = self.take_ready(max_items)
        if not ready and self._ended is not None:
            raise self._ended
        return ready

    async def _wait(self, stream: TokenStream, max_items: int, done: trio.CancelScope) -> None:
        try:
            got: list[StreamItem] = []
            while not got:  # [] is a nudge, which no one here asked for
                got = await stream.receive_batch(max_items)
        except (trio.EndOfChannel, trio.ClosedResourceError) as exc:
            self._ended = exc
        else:
            self._taken += self._relabel(stream, got)
        done.cancel()

    def _relabel(self, stream: TokenStream, items: list[StreamItem]) -> list[ChoiceItem]:
        """A finish of a choice while others go on becomes a ``ChoiceFinish``."""
        out: list[ChoiceItem] = []
        for item in items:
            if isinstance(item, FinishEvent):
                self._open.remove(stream)
                out.append(ChoiceFinish(item) if self._open else item)
            else:
                if isinstance(item, StreamError):
                    self._open.clear()
                out.append(item)
        return out

    def close(self) -> None:
        """Close every choice's stream. Sync, idempotent, never a checkpoint."""
        for stream in self.streams:
            stream.close()

    def __enter__(self) -> ChoicesSource:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


async def collect_choices(
    source: ChoicesSource, timer: RequestTimer
) -> list[tuple[str, list[TokenEvent], FinishEvent]]:
    """Read every choice to its end: (text, token events, finish) per choice, in index
    order, or ApiError for a StreamError.

    Cancellation: nothing to undo at ``source.receive_batch()``, which takes no item it
    does not return; the streams are closed by their owner, the connection."""
    index = {stream.request_id: i for i, stream in enumerate(source.streams)}
    texts: list[list[str]] = [[] for _ in source.streams]
    tokens: list[list[TokenEvent]] = [[] for _ in source.streams]
    finishes: list[FinishEvent | None] = [None for _ in source.streams]
    while any(f is None for f in finishes):
        for item in await source.receive_batch(64):
            if isinstance(item, ChoiceFinish):
                finishes[index[item.finish.request_id]] = item.finish
                continue
            timer.observe(item)
            match item:
                case TokenEvent():
                    texts[index[item.request_id]].append(item.text)
                    tokens[index[item.request_id]].append(item)
                case FinishEvent():
                    finishes[index[item.request_id]] = item
                case StreamError():
                    raise ApiError(item.type, item.message)
    return [("".join(t), k, f) for t, k, f in zip(texts, tokens, finishes, strict=True)
            if f is not None]
