"""What every wire encoder is to the one SSE body: a stream's items in, bytes out.

The body (``app.routes``) does the I/O: it reads items from its source, asks the
encoder for their bytes and writes them, and sends a keep-alive when the source is
quiet. The encoder holds only what the bytes need (the ids counted so far, the
stream's id, the model's name), so it can be tested without a server, like
``streams.sse``, and the body is the same for every route.
"""

from __future__ import annotations

from typing import Protocol, TypeVar

from streams import encode_comment

Item = TypeVar("Item")

# Sent when a stream is quiet, so that proxies and clients do not time the
# connection out; a comment, which every SSE client (and OpenAI's SDK) ignores.
KEEPALIVE_COMMENT = encode_comment("keep-alive")


class Encoder(Protocol[Item]):
    """One stream's bytes on the wire, in the order the body writes them. ``Item`` is
    what the body's source gives: a stream's items (``streams.StreamItem``) for every
    route's encoder here, a resumable stream's logged events for a resume."""

    def opening(self) -> bytes:
        """What goes before the first item (b"" for nothing)."""
        ...

    def encode(self, items: list[Item]) -> bytes:
        """Several items in one chunk, each its own event (or chunk), numbered on from
        the last one encoded; the same bytes as encoding them one at a time."""
        ...

    def error(self, error_type: str, message: str) -> bytes:
        """The failure (or farewell) event for a stream cut off after its first byte."""
        ...

    def keepalive(self) -> bytes:
        """What a quiet stream sends now and then; dispatches no event."""
        ...
