"""An Anthropic Messages stream: a stream's items as the named events the SDK reads,
and the whole ``message`` object of an answer without ``"stream": true``.

Events, each a named SSE event whose JSON data repeats its ``type`` (no ``id:`` lines)::

    message_start        {"message": {"id", "type": "message", "role": "assistant",
                          "model", "content": [], "stop_reason": null,
                          "stop_sequence": null, "usage": {"input_tokens": n,
                          "output_tokens": 0}}}
    content_block_start  {"index": 0, "content_block": {"type": "text", "text": ""}}
    ping                 {}                                  then any number of times
    content_block_delta  {"index": 0, "delta": {"type": "text_delta", "text": ...}}
                                                             one per token with text
    content_block_stop   {"index": 0}
    message_delta        {"delta": {"stop_reason", "stop_sequence"},
                          "usage": {"input_tokens": n - c,
                                    "cache_creation_input_tokens": 0,
                                    "cache_read_input_tokens": c, "output_tokens": m}}
    message_stop         {}

The opening is the first three. A token whose text is empty (a held-back stop-string
prefix or incomplete character, the end-of-sequence token) sends no delta: the API
never sends an empty one. Keep-alives are ``ping`` events, not comments. A failure after
the first byte is an ``error`` event ``{"type": "error", "error": {"type", "message"}}``,
the refusals' object, which the routes build (``ErrorEnvelope``); nothing follows it.

``stop_reason``: ``end_turn`` (the end-of-sequence token), ``max_tokens``, or
``stop_sequence`` with ``stop_sequence`` the string that matched, as the engine's stop
matcher recorded it (``FinishEvent.stop_sequence``), whichever of several it was.

With tools the answer is in the generic tool format (``app.schemas.tools``) and the
blocks follow it (``_ToolBlocks``): the opening is ``message_start`` and ``ping`` only;
a response's text is a text block, each call a block of its own::

    content_block_start  {"index": i, "content_block": {"type": "tool_use", "id":
                          "toolu_...", "name": ..., "input": {}}}
    content_block_delta  {"index": i, "delta": {"type": "input_json_delta",
                          "partial_json": <the next fragment of its input's JSON>}}
    content_block_stop   {"index": i}

and ``stop_reason`` is ``tool_use`` when a call was made (unless cut at ``max_tokens``).
A whole message has ``tool_use`` blocks with their ``input`` parsed (``{}`` if the
answer was cut before it was whole).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from engine import FinishEvent, FinishReason, TokenEvent
from streams import ErrorType, encode_event

from .output_parser import OutputEvent, ToolCalls
from .tool_call_scanner import ArgumentsDelta, CallEnd, CallStart, TextDelta

if TYPE_CHECKING:
    from streams import StreamItem

MESSAGE_ID_PREFIX = "msg_"
TOOL_USE_ID_PREFIX = "toolu_"
STOP_REASONS = {
    FinishReason.EOS: "end_turn",
    FinishReason.STOP: "stop_sequence",
    FinishReason.LENGTH: "max_tokens",
}

# Anthropic's error object for a failure of this type with this message.
AnthropicErrorEnvelope = Callable[[ErrorType, str], Mapping[str, Any]]


def _event(name: str, data: Mapping[str, Any]) -> bytes:
    # ensure_ascii: see native.encode_json_event (no U+2028 for line splitters).
    payload = json.dumps({"type": name, **data}, ensure_ascii=True, separators=(",", ":"))
    return encode_event(payload, event=name)


PING_EVENT = _event("ping", {})


def stop_reason(finish: FinishEvent) -> str:
    """The API's ``stop_reason``; a constraint's end (a STOP without a stop string: the
    answer is whole) is ``end_turn``."""
    if finish.reason is FinishReason.STOP and finish.stop_sequence is None:
        return "end_turn"
    return STOP_REASONS[finish.reason]


def matched_stop(finish: FinishEvent) -> str | None:
    """The stop sequence that ended ``finish``, or None if it ended otherwise."""
    return finish.stop_sequence if finish.reason is FinishReason.STOP else None


def message_usage(input_tokens: int, finish: FinishEvent | None) -> dict[str, int]:
    """The ``usage`` object. Before the finish the prompt's tokens are all
    ``input_tokens`` (``message_start``: the cache is looked up at admission, after it).
    After, as the API counts them, the ones found in the prefix cache are
    ``cache_read_input_tokens`` and not ``input_tokens`` (the three add up to the
    prompt); the SDK takes ``message_delta``'s values over ``message_start``'s."""
    if finish is None:
        return {"input_tokens": input_tokens, "output_tokens": 0}
    return {"input_tokens": input_tokens - finish.cached_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": finish.cached_tokens,
            "output_tokens": finish.completion_tokens}


def message_object(
    request_id: str, model: str, content: list[dict[str, Any]], input_tokens: int,
    finish: FinishEvent | None = None, *, service_tier: str | None = None,
) -> dict[str, Any]:
    """The ``message`` object: a whole answer's (with its finish), or the one
    ``message_start`` carries (none yet: no content, no stop reason). ``service_tier``:
    the tier that serves it (``app.priority_bands.anthropic_tier``), in its usage."""
    usage: dict[str, Any] = dict(message_usage(input_tokens, finish))
    if service_tier is not None:
        usage["service_tier"] = service_tier
    return {
        "id": MESSAGE_ID_PREFIX + request_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": None if finish is None else stop_reason(finish),
        "stop_sequence": None if finish is None else matched_stop(finish),
        "usage": usage,
    }


def whole_message(request_id: str, model: str, text: str, finish: FinishEvent,
                  *, tools: bool | str | None = False,
                  service_tier: str | None = None) -> dict[str, Any]:
    """The answer of a request without ``"stream": true``: one text block, or with
    ``tools`` the blocks of the tool format's answer (True: the generic format; a
    format's name: ``tool_formats.tool_scanner``); ``service_tier``: ``message_object``'s."""
    if not tools:
        return message_object(request_id, model, [{"type": "text", "text": text}],
                              finish.prompt_tokens, finish, service_tier=service_tier)
    parser = ToolCalls(TOOL_USE_ID_PREFIX + request_id, tools)
    said = parser.read_whole(text)
    content: list[dict[str, Any]] = [{"type": "text", "text": said}] if said else []
    for index, call in enumerate(parser.calls):
        content.append({"type": "tool_use", "id": parser.call_id(index),
                        "name": call.name, "input": _input(call.arguments)})
    message = message_object(request_id, model, content, finish.prompt_tokens, finish,
                             service_tier=service_tier)
    if parser.made_calls and finish.reason is not FinishReason.LENGTH:
        message["stop_reason"] = "tool_use"
    return message


def _input(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:  # a JSONDecodeError, or a number past Python's int max str digits
        return {}


class AnthropicEvents:
    """One stream's events (the module docstring).

    Args:
        request_id: the stream's id; the message's id is ``msg_`` and it.
        model: the name the message carries.
        input_tokens: the prompt's length in tokens (``message_start``'s usage).
        error_envelope: Anthropic's error object for a failure (the routes own it).
        tools: the answer is in the generic tool format (the module docstring), or
            (a format's name) in the model's own (``tool_formats.py``).
        service_tier: the tier that serves it, in ``message_start``'s usage (the
            SDK keeps it in the message it accumulates); None: not said.
    """

    def __init__(
        self,
        request_id: str,
        model: str,
        input_tokens: int,
        *,
        error_envelope: AnthropicErrorEnvelope,
        tools: bool | str | None = False,
        service_tier: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.service_tier = service_tier
        self.model = model
        self.input_tokens = input_tokens
        self.error_envelope = error_envelope
        self._tools = _ToolBlocks(request_id, tools) if tools else None

    def opening(self) -> bytes:
        """``message_start``, ``content_block_start`` and a first ``ping``."""
        message = message_object(self.request_id, self.model, [], self.input_tokens,
                                 service_tier=self.service_tier)
        if self._tools is not None:
            return _event("message_start", {"message": message}) + PING_EVENT
        return (_event("message_start", {"message": message})
                + _event("content_block_start",
                         {"index": 0, "content_block": {"type": "text", "text": ""}})
                + PING_EVENT)

    def encode(self, items: list[StreamItem]) -> bytes:
        """A delta per token with text; a finish ends the block and the message."""
        return b"".join(self._encode(item) for item in items)

    def error(self, error_type: str, message: str) -> bytes:
        """The ``error`` event; a type this server does not know is ``internal_error``."""
        try:
            kind = ErrorType(error_type)
        except ValueError:
            kind = ErrorType.INTERNAL_ERROR
        envelope = dict(self.error_envelope(kind, message))
        envelope.pop("type", None)  # _event writes it first
        return _event("error", envelope)

    def keepalive(self) -> bytes:
        return PING_EVENT

    def _encode(self, item: StreamItem) -> bytes:
        tools = self._tools
        if tools is not None and isinstance(item, TokenEvent):
            return tools.feed(item)
        if isinstance(item, TokenEvent):
            if not item.text:
                return b""
            return _event("content_block_delta",
                          {"index": 0, "delta": {"type": "text_delta", "text": item.text}})
        if isinstance(item, FinishEvent):
            delta = {"stop_reason": stop_reason(item),
                     "stop_sequence": matched_stop(item)}
            usage = message_usage(item.prompt_tokens, item)
            if tools is None:
                ended = _event("content_block_stop", {"index": 0})
            else:
                ended = tools.end()
                if tools.parser.made_calls and item.reason is not FinishReason.LENGTH:
                    delta["stop_reason"] = "tool_use"
            return (ended + _event("message_delta", {"delta": delta, "usage": usage})
                    + _event("message_stop", {}))
        return self.error(item.type, item.message)  # a StreamError


class _ToolBlocks:
    """The content blocks of an answer in the generic tool format, as they stream, of
    the one output parser (``output_parser.ToolCalls``)."""

    def __init__(self, request_id: str, tools: bool | str | None = True) -> None:
        self.request_id = request_id
        self.parser = ToolCalls(TOOL_USE_ID_PREFIX + request_id, tools)
        self._index = -1  # the last block opened
        self._open: str | None = None  # its type while it is open

    def feed(self, token: TokenEvent) -> bytes:
        return self._blocks(self.parser.feed(token))

    def end(self) -> bytes:
        """The answer ended: close its last block."""
        return self._blocks(self.parser.end()) + self._close()

    def _blocks(self, events: list[OutputEvent]) -> bytes:
        out = b""
        for event in events:
            if isinstance(event, TextDelta):
                if self._open != "text":
                    out += self._start({"type": "text", "text": ""})
                out += self._delta({"type": "text_delta", "text": event.text})
            elif isinstance(event, CallStart):
                block_id = self.parser.call_id(event.index)
                out += self._start({"type": "tool_use", "id": block_id,
                                    "name": event.name, "input": {}})
            elif isinstance(event, ArgumentsDelta) and self._open == "tool_use":
                out += self._delta({"type": "input_json_delta",
                                    "partial_json": event.fragment})
            elif isinstance(event, CallEnd):
                out += self._close()
        return out

    def _start(self, block: dict[str, Any]) -> bytes:
        out = self._close()
        self._index += 1
        self._open = block["type"]
        return out + _event("content_block_start",
                            {"index": self._index, "content_block": block})

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return _event("content_block_delta", {"index": self._index, "delta": delta})

    def _close(self) -> bytes:
        if self._open is None:
            return b""
        self._open = None
        return _event("content_block_stop", {"index": self._index})
