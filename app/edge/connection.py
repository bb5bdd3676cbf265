"""One HTTP request's ASGI connection: quart-trio's, with the ownership rules made explicit.

quart-trio (``quart_trio/asgi.py``, ``TrioASGIHTTPConnection``) runs each request as two
sibling tasks in one nursery: a receive loop and the handler (which also sends the
response body). ``StreamingConnection`` keeps that shape and adds three things:

1. Named cancel reasons: the receive loop cancels the nursery with
   ``"client disconnected"`` when ``http.disconnect`` arrives; the handler with
   ``"response sent"`` when it is done.
2. A farewell: a stream cut off by a cancel that is NOT its client's disconnect is the
   server stopping (hypercorn cancels every connection when its ``graceful_timeout``
   runs out). In a shielded, bounded scope the body's last ``error`` event, type
   ``shutdown``, is written before Cancelled goes on. Any body with a ``farewell``
   (``Farewell``: the routes' one SSE body) gets one; this module imports no route.
3. The closer: every stream a view opened is handed to the connection
   (``close_with_connection``) in the same step as it opens, recorded in the ASGI scope, and closed
   when the connection ends, however it ends, including a cancel that lands after the view returned
   but before Quart entered the body (the body's ``__aexit__`` would never run then).
   ``close()`` is idempotent, so the usual path (the body's ``__aexit__``) and this one
   do not conflict. The request's metrics timer is owned the same way (it records
   ``cancelled`` unless its stream ended).

It also counts a client that left before its response was complete (``metrics.py``),
and tells what it owns when the response's write waits for the client
(``write_blocks.py``: the protocol layers tell it where a write blocks).

The disconnect path
-------------------
``docs/cancellation.md`` walks it from the socket to the freed block, each step with its
module, function and tests. This module's part: ``handle_messages`` cancels the
request's nursery when ``http.disconnect`` arrives; the handler gets Cancelled at its
await (usually ``TokenStream.receive``, inside the body); the body's ``__aexit__``, or
``__call__``'s backstop, calls the stream's ``close()``: synchronous, idempotent, never a
checkpoint, so it runs inside the cancelled scope. A stream opened by a view belongs to
the request's connection from the moment it exists: the view calls
``close_with_connection`` right after ``Runtime.open``, with no checkpoint between.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Protocol, cast, runtime_checkable

import trio
from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable, ASGISendEvent
from quart.asgi import ASGIHTTPConnection
from quart.wrappers import Request, Response
from quart_trio.asgi import TrioASGIHTTPConnection

from ..errors import ErrorType
from ..quart_app import StreamscopeApp
from .write_blocks import serving

# The farewell is one small write to a socket that was fine a moment ago; if it cannot
# go out in this long the reader is not reading, and shutdown must not wait for it. The
# bound holds while hypercorn waits for its send lock; once its own shielded send_all
# has begun on a full socket, no deadline of ours reaches it.
FAREWELL_TIMEOUT_S = 1.0
_OWNED_STREAMS = "streamscope.streams"  # ASGI scope key: streams opened for this request
CLIENT_DISCONNECTED = "client disconnected"


class Closable(Protocol):
    """What a connection can own: ``close()`` sync, idempotent, never a checkpoint."""

    def close(self) -> None: ...


@runtime_checkable
class Farewell(Protocol):
    """A streaming body that can say goodbye when the server cuts it off."""

    def farewell(self, error_type: ErrorType, message: str) -> bytes | None:
        """The last event to write (an ``error`` of ``error_type``), or None when the
        body was never entered or has ended. Sync, never a checkpoint."""
        ...


def close_with_connection(scope: Mapping[str, Any], closable: Closable) -> None:
    """Hand ``closable`` (a TokenStream, a resume reader, the request's metrics timer, its
    API key's slot, a response's settle) to this request's connection: it is closed when
    the connection ends. Sync, never a checkpoint: call it in the same step as the stream
    opens."""
    _owned(scope).append(closable)


def _owned(scope: Mapping[str, Any]) -> list[Closable]:
    # The ASGI scope is a plain dict per request, shared by the connection and Quart's
    # request object: the natural place for what the request owns.
    owned: list[Closable] = cast(dict[str, Any], scope).setdefault(_OWNED_STREAMS, [])
    return owned


class StreamingConnection(TrioASGIHTTPConnection):
    """quart-trio's HTTP connection plus the three rules of the module docstring."""

    app: StreamscopeApp
    client_gone = False  # http.disconnect arrived before the response's last byte went out
    response_complete = False  # the response's last body message was handed to hypercorn

    async def __call__(self, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
        """Serve one request; close every stream it opened on the way out.

        Cancellation: closed by its owner: this is the owner; every stream the request
        opened is closed in a ``finally``, synchronously, before the cancel (hypercorn's,
        at shutdown) propagates: the backstop for a body Quart never entered.
        """
        serving(cast(list[object], _owned(self.scope)))  # write_blocks: for write_blocked
        try:
            await super().__call__(receive, send)
        finally:
            for stream in _owned(self.scope):
                stream.close()

    async def handle_messages(  # type: ignore[override]
        self, nursery: trio.Nursery, request: Request, receive: ASGIReceiveCallable
    ) -> None:
        """Feed the request body to Quart; on ``http.disconnect`` cancel the handler.

        Cancellation: nothing to undo: the loop only feeds the body; it is cancelled when
        the handler finished ("response sent") or the server stops, and the streams the
        request opened are closed by their owner, the connection (``__call__``).
        """
        await ASGIHTTPConnection.handle_messages(self, request, receive)
        self.note_disconnect()
        nursery.cancel_scope.cancel(reason=CLIENT_DISCONNECTED)

    def note_disconnect(self) -> None:
        """Count a client that left before its response's last byte went out.

        hypercorn sends http.disconnect at the end of every response too (from inside
        the last send): only one that comes before it is a client that left.
        """
        if not self.response_complete:
            self.client_gone = True
            self.app.metrics.disconnected()

    async def handle_request(  # type: ignore[override]
        self, nursery: trio.Nursery, request: Request, send: ASGISendCallable
    ) -> None:
        """Run the view, send its response (within its timeout), then end the request.

        Cancellation: closed by its owner, at any await: a streaming body's source is
        closed by its ``__aexit__``, or by ``__call__`` if Quart never entered it.
        """
        send = self._noting_completion(send)
        response = await self.app.handle_request(request)
        timeout = self.app.config["RESPONSE_TIMEOUT"]
        if isinstance(response, Response) and response.timeout is not Ellipsis:
            timeout = cast(float | None, response.timeout)
        with trio.move_on_after(math.inf if timeout is None else timeout):
            await self._send_response(send, response)
        nursery.cancel_scope.cancel(reason="response sent")

    def _noting_completion(self, send: ASGISendCallable) -> ASGISendCallable:
        """``send`` that sets ``response_complete`` as the last body message goes out."""

        async def send_noting_completion(message: ASGISendEvent) -> None:
            """``send``, noting the body's last message. Cancellation: nothing to undo:
            ``response_complete`` is set before the send (hypercorn's, shielded at the
            socket), so a last message whose send is cancelled still counts as
            complete."""
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                self.response_complete = True
            await send(message)

        return send_noting_completion

    async def _send_response(self, send: ASGISendCallable, response: Any) -> None:
        """Quart's send, plus the farewell of rule 2 when the server cuts a stream.

        Cancellation: the farewell is finished first (shielded, at most
        ``FAREWELL_TIMEOUT_S``, with the caveat at that constant: a client still there
        learns why its stream ended), then the cancel is re-raised; the stream was closed
        by its owner already (the body's ``__aexit__``).
        """
        try:
            await super()._send_response(send, response)
        except trio.Cancelled:
            body = getattr(response, "response", None)
            if isinstance(body, Farewell) and not self.client_gone:
                last = body.farewell(ErrorType.SHUTDOWN, "the server is stopping")
                if last is not None:
                    with trio.move_on_after(FAREWELL_TIMEOUT_S, shield=True):
                        await send({"type": "http.response.body", "body": last, "more_body": True})
                        await send({"type": "http.response.body", "body": b"", "more_body": False})
            raise
