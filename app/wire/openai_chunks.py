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

A failure after the first byte is ``data: {"error": {...}}`` then ``data: [DONE]``, as
vLLM sends it; the SDK raises it as ``APIError``. Its object is OpenAI's error envelope,
which depends on the status table of the error answers; the routes own that table, so
they hand the encoder the function that builds it (``ErrorEnvelope``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
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


class OpenAIChunks:
    """One stream's chunks (the module docstring).

    Args:
        shape: the route's chunks (``COMPLETION`` or ``CHAT``).
        request_id: the stream's id; every chunk's ``id`` is the shape's prefix and it.
        model: the name every chunk carries.
        error_envelope: OpenAI's error object for a failure (see the module docstring).
        include_usage: ``stream_options.include_usage``.
        created: every chunk's ``created``; None for now (the Unix time, whole seconds).
        tools: the answer is in the generic tool format (chat only).
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
        tools: bool = False,
    ) -> None:
        self.shape = shape
        self.request_id = request_id
        self.model = model
        self.error_envelope = error_envelope
        self.include_usage = include_usage
        # Invariant: one id and created per stream
        self.created = int(time.time()) if created is None else created
        self._chars = 0  # of the text sent so far: completions' text_offset
        self._tools = ToolDeltas(request_id) if tools else None

    def opening(self) -> bytes:
        """The shape's first chunk (chat's role), or b"" for none."""
        choice = self.shape.first_choice()
        return b"" if choice is None else self._chunk([choice])

    def encode(self, items: list[StreamItem]) -> bytes:
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

    def _encode(self, item: StreamItem) -> bytes:
        if self._tools is not None and isinstance(item, TokenEvent | FinishEvent):
            return self._encode_tools(self._tools, item)
        if isinstance(item, TokenEvent):
            logprobs = None if item.logprobs is None else self.shape.logprobs([item], self._chars)
            self._chars += len(item.text)
            return self._chunk([self.shape.delta_choice(item.text, logprobs)])
        if isinstance(item, FinishEvent):
            last = self._chunk([self.shape.last_choice(FINISH_REASONS[item.reason])])
            if self.include_usage:
                last += self._chunk([], usage=usage(item))
            return last + DONE
        return self.error(item.type, item.message)  # a StreamError

    def _encode_tools(self, tools: ToolDeltas, item: TokenEvent | FinishEvent) -> bytes:
        if isinstance(item, TokenEvent):
            return b"".join(self._chunk([_choice(d, None)]) for d in tools.feed(item.text))
        ended = b"".join(self._chunk([_choice(d, None)]) for d in tools.end())
        reason = tools.finish_reason(item, FINISH_REASONS[item.reason])
        last = ended + self._chunk([_choice({}, reason)])
        if self.include_usage:
            last += self._chunk([], usage=usage(item))
        return last + DONE

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
        if self.include_usage:
            chunk["usage"] = usage
        return _data(chunk)


def _choice(delta: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


def _data(payload: Mapping[str, Any]) -> bytes:
    # ensure_ascii: see native.encode_json_event (no U+2028 for line splitters).
    return encode_event(json.dumps(payload, ensure_ascii=True, separators=(",", ":")))
