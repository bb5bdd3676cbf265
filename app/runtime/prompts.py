"""Tokenizer work for the routes: a prompt's encode, a chat template's rendering, and
compiling a request's constraint.

Compiling (``TokenizerQueue.compile``): a constraint its tenant has compiled already is
found on the event loop (``constraint_cached`` never waits) and takes no slot: before,
every constrained request queued for the one compile thread and looked the cache up
inside it, so another key's cached ``json_object`` took 6,676 ms instead of 29 behind
six hostile compiles. A miss waits for its key's previous compile (one in flight per
key: a key's burst queues behind itself, and each key has at most one place in the
slot's first-in-first-out queue, so keys take turns), then for the slot, in all at most
``COMPILE_WAIT_S``: past that, 429 with ``Retry-After``, nothing compiled. And a key's
compiles take at most ``COMPILE_SHARE`` of a core over time: after each, its next waits
for the CPU time it took, times ``1 / COMPILE_SHARE - 1``; after a refused one,
``1 / REFUSED_SHARE - 1`` (a constraint refused for its cost costs milliseconds of CPU
to find out, holding the interpreter's lock for part of them; one key sending them back
to back would otherwise slow every stream's step).

Encodes and chat renders run in a worker thread (a 32k-character prompt takes tens of
milliseconds: never on the event loop), ``TOKENIZE_THREADS`` at a time, by the engine's
tokenizer copy that the stepping thread never uses, each owner (a key, a tenant) holding
at most one place in its first-in-first-out queue; a short prompt is encoded on the
event loop when that tokenizer is free. Knows the engine only as ``ServingEngine``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import replace
from functools import partial
from typing import Any, TypeVar

import trio

import engine
import streams

from ..errors import ApiError
from .loading import ServingEngine

_T = TypeVar("_T")

# Prompts encoded at once, each in a worker thread. The engine encodes with one tokenizer
# copy under one lock, so a second thread would only wait there, uncancellably; queued
# here instead, a request whose client leaves costs nothing.
TOKENIZE_THREADS = 1
# A prompt this short is encoded on the event loop when the encoder is free: at most about
# 0.2 ms (30 characters: 26 us; 1,024: 0.31-0.33 ms, tiny and embedded tokenizers), where a
# worker thread's round trip waits for the loop's next turn: with 256 streams writing, a
# burst of 256 requests took seconds to reach the engine one thread hop at a time.
INLINE_ENCODE_CHARS = 512
# Constraints compiled at once, each in a worker thread (the engine compiles one at a
# time anyway: a second thread would only wait there, uncancellably).
COMPILE_THREADS = 1
# The longest a constraint's compile may wait for its key's turn and the slot; then 429.
# Compiles are bounded in cost (``engine.constraint_costs``: milliseconds), so a wait
# this long means a queue of many keys' compiles: the client retries after a second.
COMPILE_WAIT_S = 10.0
COMPILE_RETRY_AFTER_S = 1.0
# The share of a core one key's compiles may take over time (see the module docstring);
# of the compiles refused (a constraint that does not compile or costs too much), much
# less: a client that sends them back to back is probing the server (8 ms of CPU each
# on the embedded tokenizer: a refusal makes its key wait about 0.4 s for its next).
COMPILE_SHARE = 0.25
REFUSED_SHARE = 0.02


class _Turn:
    """One key's compiles, one at a time: a lock and how many hold or wait for it."""

    __slots__ = ("lock", "users")

    def __init__(self) -> None:
        self.lock = trio.Lock()
        self.users = 0


class TokenizerQueue:
    """The tokenizer's work for one server, queued under one limiter (the encoding
    itself is the engine's ``engine.text.PromptEncoder``)."""

    def __init__(self, compile_wait_s: float = COMPILE_WAIT_S) -> None:
        self._limiter = trio.CapacityLimiter(TOKENIZE_THREADS)
        # Constraints compile in their own thread: a schema's compile never queues a
        # prompt's encode (nor the other way round).
        self._compiling = trio.CapacityLimiter(COMPILE_THREADS)
        self._turns: dict[Hashable, _Turn] = {}
        self._tokenizer_turns: dict[Hashable, _Turn] = {}  # encodes and renders, per owner
        self._rested_at: dict[Hashable, float] = {}  # when a key may compile again
        self.compile_wait_s = compile_wait_s

    async def compile(self, eng: ServingEngine, constraint: engine.Constraint,
                      namespace: bytes = b"", owner: Hashable = None) -> None:
        """Make sure ``namespace`` (the request's tenant) has ``constraint`` compiled,
        so that its ``submit`` on the event loop finds it: at once if it has, else in a
        worker thread after ``owner``'s (its API key's; None: the namespace's) previous
        compile and the slot, in ``compile_wait_s`` at most (see the module docstring).

        Raises:
            engine.InvalidConstraint: the library refuses it, or it costs too much.
            ApiError: 429 ``too_many_waiting`` with ``Retry-After``: no turn in time.

        Cancellation: nothing to undo: nothing was submitted. A cancel while queued lands
        at once (the turn and the slot are let go on the way out); a compile in flight
        is finished first, as the engine's cache is written whole (milliseconds, seconds
        for the very first, which builds the library's view of the tokenizer).
        """
        if eng.constraint_cached(constraint, namespace):
            await trio.lowlevel.checkpoint()
            return
        owner = namespace if owner is None else owner
        turn = self._turns.setdefault(owner, _Turn())
        turn.users += 1
        try:
            with trio.move_on_after(self.compile_wait_s) as waiting:  # the wait alone
                await trio.sleep_until(self._rested_at.get(owner, 0.0))
                await turn.lock.acquire()
                try:
                    await self._compiling.acquire()
                except BaseException:
                    turn.lock.release()
                    raise
            if not waiting.cancelled_caught:
                spent, share = [0.0], COMPILE_SHARE
                try:
                    if not eng.constraint_cached(constraint, namespace):  # not meanwhile
                        await trio.to_thread.run_sync(partial(
                            _timed, spent, eng.compile_constraint, constraint, namespace,
                            owner))
                except engine.InvalidConstraint:
                    share = REFUSED_SHARE
                    raise
                finally:
                    self._rest(owner, spent[0], share)
                    self._compiling.release()
                    turn.lock.release()
                return
        finally:
            turn.users -= 1
            if not turn.users:
                del self._turns[owner]
        raise ApiError(streams.ErrorType.TOO_MANY_WAITING,
                       f"constraints are waiting to compile; none had its turn in "
                       f"{self.compile_wait_s:g} s", retry_after_s=COMPILE_RETRY_AFTER_S)

    def _rest(self, owner: Hashable, spent_s: float, share: float) -> None:
        """``owner`` took ``spent_s`` of CPU compiling: its next compile waits so that
        its compiles take ``share`` of a core; the keys rested by now are forgotten."""
        now = trio.current_time()
        self._rested_at = {k: t for k, t in self._rested_at.items() if t > now}
        if spent_s > 0:
            start = max(now, self._rested_at.get(owner, now))
            self._rested_at[owner] = start + spent_s * (1 / share - 1)

    async def _in_turn(self, call: Callable[[], _T], owner: Hashable) -> _T:
        """``call()`` in the tokenizer's thread, after ``owner``'s previous call: each
        owner holds at most one place in the thread's first-in-first-out queue (a burst
        of one key's chat renders made another key's one-token encode wait 400 ms)."""
        turn = self._tokenizer_turns.setdefault(owner, _Turn())
        turn.users += 1
        try:
            async with turn.lock:
                return await trio.to_thread.run_sync(call, limiter=self._limiter)
        finally:
            turn.users -= 1
            if not turn.users:
                del self._tokenizer_turns[owner]

    async def encode(
        self, eng: ServingEngine, request: engine.GenerationRequest,
        owner: Hashable = None,
    ) -> engine.GenerationRequest:
        """``request`` with its ``prompt_token_ids`` (as it is if it has them already),
        encoded in ``owner``'s turn (None: its tenant's, ``cache_namespace``).

        Cancellation: nothing to undo: nothing changes. A cancel while queued for a
        tokenizer thread lands at once; an encode in flight is finished first (it takes
        milliseconds).
        """
        if request.prompt_token_ids is not None:  # render_chat encoded it
            await trio.lowlevel.checkpoint()
            return request
        ids: tuple[int, ...] | None = None
        if len(request.prompt) <= INLINE_ENCODE_CHARS:
            await trio.lowlevel.checkpoint()
            inline = eng.tokenize_if_free(request.prompt)
            ids = None if inline is None else tuple(inline)
        if ids is None:
            owner = request.cache_namespace if owner is None else owner
            ids = await self._in_turn(partial(_prompt_ids, eng, request.prompt), owner)
        return replace(request, prompt_token_ids=ids)

    async def render_chat(
        self, eng: ServingEngine, messages: Sequence[Mapping[str, str]],
        add_generation_prompt: bool, owner: Hashable = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> tuple[str, tuple[int, ...]]:
        """Chat messages (and ``tools``, for a template that renders its own) as the
        model's chat template renders them: the text and its ids, in ``owner``'s turn
        (None: one turn for every caller that names none).

        Raises:
            engine.ChatTemplateError: no chat template, or it refused the messages.

        Cancellation: nothing to undo: nothing was made. A cancel while queued lands at
        once; a render in flight is finished first (milliseconds).
        """
        render = partial(eng.render_chat, messages, add_generation_prompt, tools)
        text, ids = await self._in_turn(render, owner)
        return text, tuple(ids)


def _timed(spent: list[float], call: Callable[..., None], *args: object) -> None:
    """In a worker thread: ``call(*args)``, its CPU time in ``spent[0]`` (raised or not)."""
    started = time.thread_time()
    try:
        call(*args)
    finally:
        spent[0] = time.thread_time() - started


def _prompt_ids(eng: ServingEngine, prompt: str) -> tuple[int, ...]:
    """In a worker thread: the prompt's token ids, as ``GenerationRequest`` holds them."""
    return tuple(eng.tokenize(prompt))
