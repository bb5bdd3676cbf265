"""``/v1/stream``'s own events: a stream's items as named SSE events with ids.

Events, with SSE ids counting events from 1 (keep-alive comments carry no id)::

    start  {"id": request id, "prompt_tokens": n}                      always first, id 1
    token  {"index": i, "id": token id, "text": delta}                 one per token
           + "logprobs": {"token": its own text, "logprob": x,         if the request
             "top": [{"id", "token", "logprob"}, ...]}                 asked for them
    done   {"finish_reason": "eos"|"length"|"stop",
            "usage": {"prompt_tokens": n, "completion_tokens": m,      last, or
                      "cached_tokens": c}}     (c of the n found in the prefix cache)
    error  {"error": {"type": "slow_client"|"engine_error"|"shutdown", "message": ...}}

The data is compact JSON escaped to ASCII (``encode_json_event``). A token event, the
one made once a token, is built by hand (``token_event``) to the same bytes as the
general encoding; a test holds the two equal. A token with log-probabilities
(``engine.TokenLogprobs``: natural logs after the temperature, the likeliest first)
takes the general encoding.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from engine import FinishEvent, TokenEvent, TokenLogprobs
from streams import encode_event

from .encoder import KEEPALIVE_COMMENT

if TYPE_CHECKING:
    from streams import StreamItem


def encode_json_event(event: str, event_id: int | str, data: dict[str, Any]) -> bytes:
    """One SSE event whose data is compact JSON.

    ``ensure_ascii`` escapes everything outside ASCII: clients whose line splitter is
    ``str.splitlines()`` (httpx's own ``LineDecoder``) would break a line at U+2028.
    """
    payload = json.dumps(data, ensure_ascii=True, separators=(",", ":"))
    return encode_event(payload, event=event, id=str(event_id))


def token_event(event_id: int, item: TokenEvent) -> bytes:
    """``encode_json_event("token", event_id, item_event(item)[1])``, byte for byte (a
    test checks it), built directly: the one event made once a token. The text is a JSON
    string escaped to ASCII, so the data is one line and needs no splitting."""
    if item.logprobs is not None:  # the general encoding: a rare and larger event
        return encode_json_event("token", event_id, item_event(item)[1])
    text = json.dumps(item.text, ensure_ascii=True)
    return (f'event: token\nid: {event_id}\ndata: {{"index":{item.index},'
            f'"id":{item.token_id},"text":{text}}}\n\n').encode("ascii")


def start_event(request_id: str, prompt_tokens: int) -> tuple[str, dict[str, Any]]:
    """The ``start`` event's name and data."""
    return "start", {"id": request_id, "prompt_tokens": prompt_tokens}


def item_event(item: StreamItem) -> tuple[str, dict[str, Any]]:
    """A stream item's event name and data: ``token``, ``done`` or ``error``.

    An item that is neither a token nor a finish is the stream's error (``StreamError``,
    not imported at run time: it lives beside the stream, with Trio).
    """
    if isinstance(item, TokenEvent):
        data: dict[str, Any] = {"index": item.index, "id": item.token_id, "text": item.text}
        if item.logprobs is not None:
            data["logprobs"] = logprobs_data(item.logprobs)
        return "token", data
    if isinstance(item, FinishEvent):
        return "done", {"finish_reason": item.reason.value, "usage": usage_data(item)}
    return "error", error_data(item.type, item.message)


def usage_data(finish: FinishEvent) -> dict[str, int]:
    """The native routes' usage (``done``'s and ``/v1/generate``'s): ``cached_tokens``
    of the ``prompt_tokens`` were found in the prefix cache."""
    return {"prompt_tokens": finish.prompt_tokens,
            "completion_tokens": finish.completion_tokens,
            "cached_tokens": finish.cached_tokens}


def logprobs_data(logprobs: TokenLogprobs) -> dict[str, Any]:
    """A token's log-probabilities as the native events (and ``/v1/generate``) carry them."""
    return {"token": logprobs.token, "logprob": logprobs.logprob,
            "top": [{"id": i, "token": text, "logprob": value}
                    for i, text, value in logprobs.top]}


def error_data(error_type: str, message: str) -> dict[str, Any]:
    """An ``error`` event's data, the same inner object as a refusal's envelope."""
    return {"error": {"type": error_type, "message": message}}


class NativeEvents:
    """One stream's events (the module docstring), ids counting from 1.

    Args:
        request_id: the stream's id, in the ``start`` event.
        prompt_tokens: the prompt's length in tokens, in the ``start`` event.
    """

    def __init__(self, request_id: str, prompt_tokens: int) -> None:
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self._next_id = 1

    def opening(self) -> bytes:
        """Event 1, ``start``."""
        return self._event(*start_event(self.request_id, self.prompt_tokens))

    def encode(self, items: list[StreamItem]) -> bytes:
        """Each item its own event, with the next ids."""
        events = []
        for item in items:
            if isinstance(item, TokenEvent):  # the hot path: one a token, by hand
                event_id, self._next_id = self._next_id, self._next_id + 1
                events.append(token_event(event_id, item))
            else:
                events.append(self._event(*item_event(item)))
        return b"".join(events)

    def error(self, error_type: str, message: str) -> bytes:
        """An ``error`` event with the next id."""
        return self._event("error", error_data(error_type, message))

    def keepalive(self) -> bytes:
        return KEEPALIVE_COMMENT

    def _event(self, name: str, data: dict[str, Any]) -> bytes:
        event_id, self._next_id = self._next_id, self._next_id + 1
        return encode_json_event(name, event_id, data)
