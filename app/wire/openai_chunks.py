"""An OpenAI-compatible stream: a stream's items as ``data:`` chunks, then ``[DONE]``.

``data:`` lines only, one ``id`` and ``created`` for the whole stream: no ``event:``,
``id:`` or ``retry:`` line ever, as the SDK's decoder parses every block it dispatches
as JSON (openai-python issues 2722 and 3833). Keep-alives are comment lines, which it
ignores. The chunks' choices are the route's shape (``openai_shapes.py``); with
``stream_options.include_usage`` every chunk carries ``usage`` (null), and after the
last choice one more chunk with ``choices: []`` has the totals. Then ``data: [DONE]``.
A token of a request that asked for log-probabilities carries its own in its chunk, as
the whole answer has them (``openai_shapes.py``). A chat answer with tools is in the
generic tool format: its chunks are the tool-call or content deltas of ``ToolDeltas``
(``openai_tools.py``).

Several choices (``n``): each is a stream of its own (its own request id), and its
chunks carry its ``index``; chat opens with a role chunk per choice; a choice that ends
while others go on comes as a ``ChoiceFinish`` (its last chunk, no ``[DONE]``), and the
last one to end as its ``FinishEvent``: then the usage chunk (the prompt once, the
completions' tokens summed) and ``[DONE]``, as OpenAI and vLLM send them.

A failure after the first byte is ``data: {"error": {...}}`` then ``data: [DONE]``, as
vLLM sends it; the SDK raises it as ``APIError``. Its object is OpenAI's error envelope,
which depends on the status table of the error answers; the routes own that table, so
they hand the encoder the function that builds it (``ErrorEnvelope``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine import FinishEvent, TokenEvent
from streams import ErrorType, encode_event

from .encoder import KEEPALIVE_COMMENT
from .openai_shapes import FINISH_REASONS, ChoiceShape, usage
from .openai_tools import ToolDeltas

if TYPE_CHECKING:
    from streams import StreamItem

DONE = encode_event("[DONE]")

# OpenAI's error object for a failure of this type with this message (no ``param``).
ErrorEnvelope = Callable[[ErrorType, str], Mapping[str, Any]]


@dataclass(frozen=True, slots=True)
class ChoiceFinish:
    """One choice of several ended while others go on: its finish, not the stream's end
    (the source of several choices, ``app.routes.choices``, gives it)."""

    finish: FinishEvent


def choices_usage(finishes: Sequence[FinishEvent]) -> dict[str, Any]:
    """The usage of several choices of one prompt: the prompt (and what of it was found
    cached) counted once, as the first choice's, the completions' tokens summed."""
    first = usage(finishes[0])
    completion = sum(f.completion_tokens for f in finishes)
    first["completion_tokens"] = completion
    first["total_tokens"] = first["prompt_tokens"] + completion
    return first


class OpenAIChunks:
    """One stream's chunks (the module docstring).

    Args:
        shape: the route's chunks (``COMPLETION`` or ``CHAT``).
        request_id: the stream's id; every chunk's ``id`` is the shape's prefix and it.
        model: the name every chunk carries.
        error_envelope: OpenAI's error object for a failure (see the module docstring).
        include_usage: ``stream_options.include_usage``.
        created: every chunk's ``created``; None for now (the Unix time, whole seconds).
        tools: the answer is in the generic tool format (True) or the format of that
            name (``tool_formats.tool_scanner``) (chat only).
        choices: the request ids of several choices, in ``index`` order (the first is
            ``request_id``); None for one.
        service_tier: the tier that serves it (``app.priority_bands.openai_tier``), which
            every chunk says, as OpenAI's do; None: not said.
    """

    def __init__(
        self,
        shape: ChoiceShape,
        request_id: str,
        model: str,
        *,
        error_envelope: ErrorEnvelope,
        include_usage: bool = False,
        created: int | None = None,
        tools: bool | str | None = False,
        choices: Sequence[str] | None = None,
        service_tier: str | None = None,
    ) -> None:
        self.shape = shape
        self.service_tier = service_tier
        self.request_id = request_id
        self.model = model
        self.error_envelope = error_envelope
        self.include_usage = include_usage
        # Invariant: one id and created per stream
        self.created = int(time.time()) if created is None else created
        ids = list(choices or [request_id])
        self._index = {rid: index for index, rid in enumerate(ids)}
        self._chars = [0] * len(ids)  # of each choice's text sent so far: text_offset
        self._tools = [ToolDeltas(rid, tools) for rid in ids] if tools else None
        self._finishes: list[FinishEvent] = []  # the choices ended so far

    def opening(self) -> bytes:
        """The shape's first chunk (chat's role) for each choice, or b"" for none."""
        choice = self.shape.first_choice()
        if choice is None:
            return b""
        return b"".join(self._chunk([{**choice, "index": index}])
                        for index in range(len(self._chars)))

    def encode(self, items: Sequence[StreamItem | ChoiceFinish]) -> bytes:
        """Each item its own chunk; a finish or an error ends with ``[DONE]``."""
        return b"".join(self._encode(item) for item in items)

    def error(self, error_type: str, message: str) -> bytes:
        """The error chunk, then ``[DONE]``; a type this server does not know is
        reported as ``internal_error``."""
        try:
            kind = ErrorType(error_type)
        except ValueError:
            kind = ErrorType.INTERNAL_ERROR
        return _data(self.error_envelope(kind, message)) + DONE

    def keepalive(self) -> bytes:
        return KEEPALIVE_COMMENT

    def _encode(self, item: StreamItem | ChoiceFinish) -> bytes:
        if isinstance(item, ChoiceFinish):
            self._finishes.append(item.finish)
            return self._last_chunk(item.finish)
        if isinstance(item, TokenEvent):
            index = self._index[item.request_id]
            if self._tools is not None:
                return b"".join(self._chunk([_choice(index, d, None)])
                                for d in self._tools[index].feed(item))
            logprobs = (None if item.logprobs is None
                        else self.shape.logprobs([item], self._chars[index]))
            self._chars[index] += len(item.text)
            return self._chunk([{**self.shape.delta_choice(item.text, logprobs),
                                 "index": index}])
        if isinstance(item, FinishEvent):
            self._finishes.append(item)
            last = self._last_chunk(item)
            if self.include_usage:
                last += self._chunk([], usage=choices_usage(self._finishes))
            return last + DONE
        return self.error(item.type, item.message)  # a StreamError

    def _last_chunk(self, finish: FinishEvent) -> bytes:
        """A choice's last chunk: its finish reason (after its tool calls' last deltas)."""
        index = self._index[finish.request_id]
        reason = FINISH_REASONS[finish.reason]
        if self._tools is None:
            return self._chunk([{**self.shape.last_choice(reason), "index": index}])
        tools = self._tools[index]
        ended = b"".join(self._chunk([_choice(index, d, None)]) for d in tools.end())
        return ended + self._chunk([_choice(index, {}, tools.finish_reason(finish, reason))])

    def _chunk(
        self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None
    ) -> bytes:
        chunk: dict[str, Any] = {
            "id": self.shape.id_prefix + self.request_id,
            "object": self.shape.chunk_object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.service_tier is not None:
            chunk["service_tier"] = self.service_tier
        if self.include_usage:
            chunk["usage"] = usage
        return _data(chunk)


def _choice(index: int, delta: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


def _data(payload: Mapping[str, Any]) -> bytes:
    # ensure_ascii: see native.encode_json_event (no U+2028 for line splitters).
    return encode_event(json.dumps(payload, ensure_ascii=True, separators=(",", ":")))
