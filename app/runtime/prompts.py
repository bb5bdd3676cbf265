"""Tokenizer work for the routes: a prompt's encode, a chat template's rendering, and
compiling a request's constraint.

Both run in a worker thread (a 32k-character prompt takes tens of milliseconds: never on
the event loop), ``TOKENIZE_THREADS`` at a time, by the engine's tokenizer copy that the
stepping thread never uses; a short prompt is encoded on the event loop when that
tokenizer is free. Knows the engine only as ``ServingEngine``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from functools import partial

import trio

import engine

from .loading import ServingEngine

# Prompts encoded at once, each in a worker thread. The engine encodes with one tokenizer
# copy under one lock, so a second thread would only wait there, uncancellably; queued
# here instead, a request whose client leaves costs nothing.
TOKENIZE_THREADS = 1
# A prompt this short is encoded on the event loop when the encoder is free: at most about
# 0.2 ms (30 characters: 26 us; 1,024: 0.31-0.33 ms, tiny and embedded tokenizers), where a
# worker thread's round trip waits for the loop's next turn: with 256 streams writing, a
# burst of 256 requests took seconds to reach the engine one thread hop at a time.
INLINE_ENCODE_CHARS = 512


class PromptEncoder:
    """The tokenizer's work for one server, queued under one limiter."""

    def __init__(self) -> None:
        self._limiter = trio.CapacityLimiter(TOKENIZE_THREADS)
        # Constraints compile in their own thread: a schema's compile never queues a
        # prompt's encode (nor the other way round).
        self._compiling = trio.CapacityLimiter(1)

    async def compile(self, eng: ServingEngine, constraint: engine.Constraint) -> None:
        """Compile a request's constraint in a worker thread (the engine caches it, so
        its ``submit`` on the event loop finds it compiled).

        Raises:
            engine.InvalidConstraint: the library refuses it.

        Cancellation: while queued, or while a compile runs (never abandoned: the
        engine's cache is written whole; milliseconds, seconds for the very first,
        which builds the library's view of the tokenizer): nothing was submitted.
        """
        await trio.to_thread.run_sync(partial(eng.compile_constraint, constraint),
                                      limiter=self._compiling)

    async def encode(
        self, eng: ServingEngine, request: engine.GenerationRequest
    ) -> engine.GenerationRequest:
        """``request`` with its ``prompt_token_ids`` (as it is if it has them already).

        Cancellation: while queued for a tokenizer thread, or while an encode runs (it
        is never abandoned; it takes milliseconds): nothing changes.
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
            ids = await trio.to_thread.run_sync(partial(_prompt_ids, eng, request.prompt),
                                                limiter=self._limiter)
        return replace(request, prompt_token_ids=ids)

    async def render_chat(
        self, eng: ServingEngine, messages: Sequence[Mapping[str, str]],
        add_generation_prompt: bool,
    ) -> tuple[str, tuple[int, ...]]:
        """Chat messages as the model's chat template renders them: the text and its ids.

        Raises:
            engine.ChatTemplateError: no chat template, or it refused the messages.

        Cancellation: while queued or rendering (never abandoned; milliseconds):
        nothing was made.
        """
        render = partial(eng.render_chat, messages, add_generation_prompt)
        text, ids = await trio.to_thread.run_sync(render, limiter=self._limiter)
        return text, tuple(ids)


def _prompt_ids(eng: ServingEngine, prompt: str) -> tuple[int, ...]:
    """In a worker thread: the prompt's token ids, as ``GenerationRequest`` holds them."""
    return tuple(eng.tokenize(prompt))
