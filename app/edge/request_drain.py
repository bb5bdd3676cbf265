"""A response that starts before its request body arrived: the body drained, or
``Connection: close``.

Ours, not an upstream bug (``closing_server.ClosingTCPServer`` wraps it around the app for
every HTTP/1 request): a response that goes out before its request body arrived (a 404 or
413 that never reads the body) leaves h11 unable to reuse the connection (hypercorn closes
it, at ``closing_server``'s fix). It would come down to a race whether the client's next
request on it got through: httpx writes a request's head and its body separately, and a
404 could finish between the two. So before a response starts, a small request body is
waited for (drained, by Quart's receive loop that reads the body anyway, to at most
``DRAIN_LIMIT_BYTES`` for at most ``DRAIN_TIMEOUT_S``) and the connection is reused; a
larger, chunked or late one gets ``Connection: close`` in the response, so the client
knows not to reuse it, and the connection closes after it.
"""

from __future__ import annotations

from typing import Any, cast

import trio
from hypercorn.typing import (
    ASGIReceiveCallable,
    ASGIReceiveEvent,
    ASGISendCallable,
    ASGISendEvent,
)

# A request body this small is read rather than thrown away with its connection: a few
# TCP segments, less than a new connection costs (Go's net/http drains 256 KiB).
DRAIN_LIMIT_BYTES = 64 * 1024
# How long a response waits for such a body to arrive before it closes the connection
# instead: enough for a body already sent, short for one that is not coming.
DRAIN_TIMEOUT_S = 1.0
_HTTP1 = {"1.0", "1.1"}


def settle_request_body(
    scope: dict[str, Any], receive: ASGIReceiveCallable, send: ASGISendCallable
) -> tuple[ASGIReceiveCallable, ASGISendCallable]:
    """Wrap one HTTP/1 request's ``receive`` and ``send`` so its response starts only once
    its body has arrived, or says ``Connection: close`` (see the module docstring).

    The app must read ``receive`` to the end concurrently with its response (quart-trio
    does: its receive loop runs until ``http.disconnect``).
    """
    if scope.get("type") != "http" or scope.get("http_version") not in _HTTP1:
        return receive, send
    declared = _declared_length(scope)
    body_done = trio.Event()

    async def watched_receive() -> ASGIReceiveEvent:
        """``receive``, noting the body's end. Cancellation: nothing to undo, as
        ``receive``'s: the message is returned with no checkpoint after it."""
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            body_done.set()  # the body's end, or a disconnect: nothing more will come
        return message

    async def settled_send(message: ASGISendEvent) -> None:
        """Cancellation: nothing to undo while it waits for the body: nothing was
        sent."""
        if message["type"] == "http.response.start" and not body_done.is_set():
            if declared is not None and declared <= DRAIN_LIMIT_BYTES:
                with trio.move_on_after(DRAIN_TIMEOUT_S):
                    await body_done.wait()
            if not body_done.is_set():
                headers = [*message.get("headers", []), (b"connection", b"close")]
                message = cast(ASGISendEvent, {**message, "headers": headers})
        await send(message)

    return watched_receive, settled_send


def _declared_length(scope: dict[str, Any]) -> int | None:
    """The request body's Content-Length; 0 without one; None when chunked (unknown)."""
    length = 0
    for name, value in scope.get("headers", []):
        name = bytes(name).lower()
        if name == b"transfer-encoding":
            return None
        if name == b"content-length":
            length = int(value)  # h11 has validated it
    return length
