"""hypercorn's HTTP/1.1 trio connection, ending when it should: ``ClosingTCPServer``.

Known for hypercorn 0.18.0 with h11 0.16 (pinned in ``pyproject.toml``; ``hypercorn_patches``
checks the pins and installs this server). Upstream: pgjones/hypercorn#330
("Connection:close ignored?", open; related: #106). Drop ``ClosingTCPServer``'s close and
timer fixes when upstream fixes it, and check ``tests/test_http_connection.py`` still
passes without them.

The cause (hypercorn 0.18, ``protocol/h11.py`` and ``trio/tcp_server.py``): a response's
end runs in the ASGI app's own task, inside quart-trio's per-request nursery:
``send(last body)`` -> ``HTTPStream._send_closed`` -> ``H11Protocol._maybe_recycle``.
That first puts ``http.disconnect`` in the app's queue (a checkpoint), and quart-trio's
receive loop, seeing it, cancels the request's nursery: the disconnect signal this server
relies on. ``_maybe_recycle`` goes on in the now cancelled task and sends either
``Closed`` (``Connection: close``, HTTP/1.0, an unread request body) -> ``TCPServer._close``
-> ``send_eof``, whose first checkpoint raises ``Cancelled`` before the socket is shut
down or closed; or ``Updated(idle=True)`` -> the keep-alive timer's restart, whose lock
raises ``Cancelled`` the same way. So: no EOF after ``Connection: close`` or HTTP/1.0, an
idle keep-alive connection never times out, and a connection that should close stays open
with no request in it, holding the next request sent on it unanswered forever (its bytes
are parsed, but ``_handle_events`` only breaks or waits for a cycle that never starts).
``ClosingTCPServer`` shields those two steps: a shutdown and a timer restart never block.

A third fault, found by the fuzz test (``tests/test_fuzz_http.py``): ``_close`` calls
``send_eof`` without the connection's ``send_lock``, so a write under the lock in another
task (hypercorn's own 400 for a body that ended early, while the app's task closes) raises
``trio.BusyResourceError``, which nothing catches: it ended the whole worker process.
``ClosingTCPServer`` treats it as what it means, the connection is closing (the bytes
could not go out anyway), and logs and drops any other exception of one connection rather
than let it end the server.

The server serves the app with two wrappers of ours around each HTTP/1 request:
``request_drain.settle_request_body`` (a response before its request body) and
``body_hot_path.direct_body_send`` (a body's chunk written straight to the socket).
"""

from __future__ import annotations

import logging
from typing import Any, cast

import trio
from hypercorn.config import Config
from hypercorn.events import Closed, Event, RawData, Updated
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import (
    AppWrapper,
    ASGIReceiveCallable,
    ASGISendCallable,
    LifespanState,
    Scope,
)

from .body_hot_path import direct_body_send
from .request_drain import settle_request_body

log = logging.getLogger("streamscope.http")


class ClosingTCPServer(TCPServer):
    """hypercorn's trio connection, whose close and keep-alive timer survive a cancel,
    serving the app with ``settle_request_body``.

    Both run shielded: ``_close`` is a ``shutdown(SHUT_WR)`` and a ``close()``, the
    timer's restart a lock held for no I/O, so neither can block.
    """

    def __init__(
        self,
        app: AppWrapper,
        config: Config,
        context: WorkerContext,
        state: LifespanState,
        stream: trio.SSLStream[trio.SocketStream],
    ) -> None:
        super().__init__(_SettlingApp(app, self), config, context, state, stream)

    async def _close(self) -> None:
        """hypercorn's close of the connection (``shutdown(SHUT_WR)``, ``close()``).

        Cancellation: finished first (shielded): a cancel (the server stopping, the
        connection's own task cancelled) must not leave the socket open; the close takes
        no I/O wait, so the shield holds nothing up.
        """
        with trio.CancelScope(shield=True):
            await super()._close()

    async def run(self) -> None:
        """Serve the connection; a bug in it ends it alone, never the server.

        Cancellation: the server stops: the connection's tasks are cancelled, and its
        socket closed on the way out (``_close``, shielded: finished first); the app's
        streams are closed by their owner, the connection.
        """
        try:
            await super().run()
        except* Exception as group:
            log.exception("a connection failed; it was closed", exc_info=group)

    async def protocol_send(self, event: Event) -> None:
        """hypercorn's send of a protocol event, with two fixes: the keep-alive timer's
        restart (``Updated``) survives a cancel, and a write that meets ``_close``'s
        send_eof (``BusyResourceError``) closes the protocol instead of failing.

        Cancellation: ``Updated`` is finished first (shielded; a lock held for no I/O,
        so the timer is never left stopped by a cancel); anything else is hypercorn's: a
        ``RawData`` cancelled at the socket's wait may be partly sent, which only a
        connection that is ending meets, so nothing is left to undo.
        """
        if isinstance(event, Updated):
            with trio.CancelScope(shield=True):
                await super().protocol_send(event)
        elif isinstance(event, RawData):
            try:
                await super().protocol_send(event)
            except trio.BusyResourceError:
                # Another task is in ``_close``'s send_eof: the connection is closing.
                await self.protocol.handle(Closed())
        else:
            await super().protocol_send(event)


class _SettlingApp:
    """hypercorn's app wrapper, with ``settle_request_body`` and ``direct_body_send``
    around each request."""

    def __init__(self, app: AppWrapper, server: ClosingTCPServer) -> None:
        self.app = app
        self.server = server

    async def __call__(
        self,
        scope: Scope,
        receive: ASGIReceiveCallable,
        send: ASGISendCallable,
        sync_spawn: Any,
        call_soon: Any,
    ) -> None:
        """Run the app on one request with the wrappers.

        Cancellation: nothing to undo here: the wrappers hold no resource; the cancel
        reaches the app (quart-trio's request nursery), whose streams are closed by
        their owner, the connection.
        """
        plain = cast(dict[str, Any], scope)
        receive, send = settle_request_body(plain, receive, send)
        send = direct_body_send(self.server, plain, send)
        await self.app(scope, receive, send, sync_spawn, call_soon)
