"""The OpenAI Responses API's stream: a stream's items as typed, numbered events.

One SSE event per semantic event, ``event:`` its type and ``data:`` its JSON body, which
repeats ``type`` and carries a ``sequence_number`` that starts at 0 and rises by one:

    response.created, response.in_progress
    for each output item, in order:
      a message:       output_item.added, content_part.added, output_text.delta ...,
                       output_text.done, content_part.done, output_item.done
      a function call: output_item.added, function_call_arguments.delta ...,
                       function_call_arguments.done, output_item.done
    response.completed | response.incomplete (max_output_tokens) | response.failed

No ``id:`` line is ever sent: openai-python's decoder keeps the last event id, and a
comment line after one dispatches an empty event it cannot parse (openai-python issues
2722 and 3833); so a keep-alive, a comment, is safe here as on the chat route. The
sequence numbers are what a reader resumes from (``starting_after``): the events are a
pure function of the stream's items, so encoding the same items again gives the same
numbers, and a resumed reader skips those it has (``skip_through``).

What the model's text becomes is the ``OutputParser``'s job (``output_parser``, the one
every encoder takes): plain text by default (``PlainText``), or the tool-call parser
(``ToolCalls``) when the request has tools, which turns the constrained output into
function calls, each with its id (``call_id``). The encoder only numbers and frames its
deltas.
The response object itself (``ResponseObject``) is built once from the request and
updated here as the output grows, so the final event and ``GET /v1/responses/{id}``
show the same document.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from engine import FinishEvent, FinishReason, TokenEvent
from streams import encode_event

from .encoder import KEEPALIVE_COMMENT
from .output_parser import OutputEvent, OutputParser
from .tool_call_scanner import ArgumentsDelta, CallStart, TextDelta

if TYPE_CHECKING:
    from streams import StreamItem


# OpenAI's error object for a failure of this type with this message.
ErrorBody = Callable[[str, str], Mapping[str, Any]]


class ResponseEvents:
    """One response's events (the module docstring); an ``app.wire.Encoder``.

    Args:
        response: the response object as created (``status`` queued or in_progress,
            ``output`` empty); this encoder fills in its output, status and usage.
        parser: what the model's text becomes (``PlainText`` or ``ToolCalls``).
        new_id: makes an output item's id from a prefix (``msg``, ``fc``).
        skip_through: a resumed reader's ``starting_after``: events numbered up to it
            are not sent again.
        on_final: told of the response object once it is final (its last event, or
            the ``error`` event after the first byte), once.
    """

    def __init__(self, response: dict[str, Any], parser: OutputParser,
                 new_id: Callable[[str], str], *, skip_through: int = -1,
                 on_final: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.response = response
        self.parser = parser
        self.new_id = new_id
        self.skip_through = skip_through
        self.on_final = on_final
        self.is_final = False
        self.sequence_number = 0  # of the next event
        self._item: dict[str, Any] | None = None  # the output item being written
        self._text: list[str] = []  # of the open message, or the open call's arguments
        self._logprobs: list[dict[str, Any]] = []

    # -- the Encoder protocol ------------------------------------------------------------

    def opening(self) -> bytes:
        created = self._event("response.created", response=self.snapshot())
        self.response["status"] = "in_progress"
        return created + self._event("response.in_progress", response=self.snapshot())

    def encode(self, items: list[StreamItem]) -> bytes:
        return b"".join(self._encode(item) for item in items)

    def error(self, error_type: str, message: str) -> bytes:
        """The ``error`` event for a stream cut off after its first byte."""
        self.response["status"] = "failed"
        self.response["error"] = {"code": error_type, "message": message}
        event = self._event("error", code=error_type, message=message, param=None)
        self._final()
        return event

    def keepalive(self) -> bytes:
        return KEEPALIVE_COMMENT

    def snapshot(self) -> dict[str, Any]:
        """The response object as it stands (a copy: later events do not change it)."""
        return json.loads(json.dumps(self.response))

    # -- items to events -----------------------------------------------------------------

    def _encode(self, item: StreamItem) -> bytes:
        if isinstance(item, TokenEvent):
            return b"".join(self._delta(d) for d in self.parser.feed(item))
        if isinstance(item, FinishEvent):
            return self._finish(item)
        return self.error(str(item.type.value), item.message)  # a StreamError

    def _delta(self, delta: OutputEvent) -> bytes:
        if isinstance(delta, TextDelta):
            opened = b"" if self._is_open("message") else self._close() + self._open_message()
            self._text.append(delta.text)
            self._logprobs.extend(delta.logprobs)
            return opened + self._event(
                "response.output_text.delta", **self._where(content_index=0),
                delta=delta.text, logprobs=list(delta.logprobs))
        if isinstance(delta, CallStart):
            return self._close() + self._open_call(delta)
        if not isinstance(delta, ArgumentsDelta):  # a CallEnd: the next item closes it
            return b""
        self._text.append(delta.fragment)
        return self._event("response.function_call_arguments.delta", **self._where(),
                           delta=delta.fragment)

    def _open_message(self) -> bytes:
        self._item = {"id": self.new_id("msg"), "type": "message", "status": "in_progress",
                      "role": "assistant", "content": []}
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return (self._added() + self._event("response.content_part.added",
                                            **self._where(content_index=0), part=part))

    def _open_call(self, call: CallStart) -> bytes:
        self._item = {"id": self.new_id("fc"), "type": "function_call",
                      "status": "in_progress", "call_id": self.parser.call_id(call.index),
                      "name": call.name,
                      "arguments": ""}
        return self._added()

    def _added(self) -> bytes:
        assert self._item is not None
        self._text, self._logprobs = [], []
        return self._event("response.output_item.added", output_index=self._output_index(),
                           item=dict(self._item))

    def _close(self, status: str = "completed") -> bytes:
        """End the open output item, if any, and add it to the response's output."""
        item, self._item = self._item, None
        if item is None:
            return b""
        text = "".join(self._text)
        where = {"item_id": item["id"], "output_index": self._output_index()}
        item["status"] = status
        if item["type"] == "message":
            part = {"type": "output_text", "text": text, "annotations": [],
                    "logprobs": list(self._logprobs)}
            item["content"] = [part]
            done = (self._event("response.output_text.done", **where, content_index=0,
                                text=text, logprobs=list(self._logprobs))
                    + self._event("response.content_part.done", **where, content_index=0,
                                  part=part))
        else:
            item["arguments"] = text
            done = self._event("response.function_call_arguments.done", **where,
                               name=item["name"], arguments=text)
        self.response["output"].append(item)
        return done + self._event("response.output_item.done",
                                  output_index=where["output_index"], item=item)

    def _finish(self, finish: FinishEvent) -> bytes:
        last = self._last_event(finish)
        self._final()
        return last

    def _final(self) -> None:
        if not self.is_final:
            self.is_final = True
            if self.on_final is not None:
                self.on_final(self.snapshot())

    def _last_event(self, finish: FinishEvent) -> bytes:
        tail = b"".join(self._delta(d) for d in self.parser.end())
        incomplete = finish.reason is FinishReason.LENGTH
        tail += self._close("incomplete" if incomplete else "completed")
        self.response["usage"] = {
            "input_tokens": finish.prompt_tokens,
            "input_tokens_details": {"cached_tokens": finish.cached_tokens,
                                     "cache_write_tokens": 0},
            "output_tokens": finish.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": finish.prompt_tokens + finish.completion_tokens,
        }
        if finish.reason in (FinishReason.ERROR, FinishReason.DEADLINE):
            self.response["status"] = "failed"
            self.response["error"] = {"code": "server_error" if finish.reason is
                                      FinishReason.ERROR else "deadline_missed",
                                      "message": finish.error or "the request failed"}
            return tail + self._event("response.failed", response=self.snapshot())
        if incomplete:
            self.response["status"] = "incomplete"
            self.response["incomplete_details"] = {"reason": "max_output_tokens"}
            return tail + self._event("response.incomplete", response=self.snapshot())
        if finish.reason is FinishReason.CANCELLED:
            self.response["status"] = "cancelled"
            return tail + self._event("response.failed", response=self.snapshot())
        self.response["status"] = "completed"
        return tail + self._event("response.completed", response=self.snapshot())

    # -- framing ---------------------------------------------------------------------------

    def _is_open(self, kind: str) -> bool:
        return self._item is not None and self._item["type"] == kind

    def _output_index(self) -> int:
        return len(self.response["output"])

    def _where(self, **more: Any) -> dict[str, Any]:
        assert self._item is not None
        return {"item_id": self._item["id"], "output_index": self._output_index(), **more}

    def _event(self, event_type: str, **body: Any) -> bytes:
        number = self.sequence_number
        self.sequence_number += 1
        if number <= self.skip_through:
            return b""
        payload = {"type": event_type, "sequence_number": number, **body}
        # ensure_ascii: see native.encode_json_event (no U+2028 for line splitters).
        return encode_event(json.dumps(payload, ensure_ascii=True, separators=(",", ":")),
                            event=event_type)
