"""A resumable stream's events: ``/v1/stream``'s, with ids that name the stream.

Every id is ``<request_id>:<n>``, n counting events from 1 as on a plain stream, so a
client that reconnects with ``Last-Event-ID`` says which stream and where. The resume
registry (``streams.resume``) logs each event as it is made and numbers them itself:
it calls the encoder with each item's n (``ResumableEvents(n, item)``); ``encode``
numbers on from the last event made, for a body that encodes as it writes.

Two pieces are not events of the stream and carry no id, so that an EventSource keeps
its Last-Event-ID: the ``retry`` line a resumed response opens with, and the ``error``
event that ends a reader's body (``error``; ``TAKEN_OVER_EVENT`` when a newer reader
took the stream over).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from streams import ErrorType, encode_event

from .encoder import KEEPALIVE_COMMENT
from .native import encode_json_event, error_data, item_event, start_event

if TYPE_CHECKING:
    from streams import StreamItem

# How soon an EventSource reconnects after its connection dropped (the ``retry`` field,
# in ms): well within the grace period, and not a tight loop against a server that
# is briefly away.
RETRY_MS = 1000
RETRY_LINE = f"retry: {RETRY_MS}\n".encode()  # a field line alone: applied, dispatches nothing


def event_without_id(error_type: str, message: str) -> bytes:
    """An ``error`` event outside the stream's numbering (no id)."""
    return encode_event(json.dumps(error_data(error_type, message), separators=(",", ":")),
                        event="error")


# The old reader's last event when a newer one took its stream over.
TAKEN_OVER_EVENT = event_without_id(ErrorType.TAKEN_OVER, "another reader took this stream over")


class ResumableEvents:
    """One resumable stream's events (the module docstring).

    Args:
        request_id: the stream's id, in every event id and the ``start`` event.
        prompt_tokens: the prompt's length in tokens, in the ``start`` event.
    """

    def __init__(self, request_id: str, prompt_tokens: int) -> None:
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self._last_n = 0  # the n of the last event made

    def opening(self) -> bytes:
        """Event 1, ``start``."""
        self._last_n = 1
        name, data = start_event(self.request_id, self.prompt_tokens)
        return encode_json_event(name, self._id(1), data)

    def __call__(self, n: int, item: StreamItem) -> bytes:
        """Event ``n``, of ``item``: the registry's encoder (it numbers the events)."""
        self._last_n = n
        name, data = item_event(item)
        return encode_json_event(name, self._id(n), data)

    def encode(self, items: list[StreamItem]) -> bytes:
        """Each item its own event, numbered on from the last one made."""
        return b"".join(self(self._last_n + 1, item) for item in items)

    def error(self, error_type: str, message: str) -> bytes:
        """The ``error`` event that ends a reader's body, without an id."""
        return event_without_id(error_type, message)

    def keepalive(self) -> bytes:
        return KEEPALIVE_COMMENT

    def _id(self, n: int) -> str:
        return f"{self.request_id}:{n}"
