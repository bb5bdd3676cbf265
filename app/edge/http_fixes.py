"""Fixes at hypercorn's HTTP/1.1 edge under trio: connections that end when they should.

Known for hypercorn 0.18.0 with h11 0.16 (pinned in ``pyproject.toml``). Upstream:
pgjones/hypercorn#330 ("Connection:close ignored?", open; related: #106). Drop
``ClosingTCPServer`` when upstream fixes it, and check ``tests/test_http_connection.py``
still passes without it.

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

The other half, ``settle_request_body`` (which ``ClosingTCPServer`` wraps around the app
for every HTTP/1 request), is ours: a response that goes out before its
request body arrived (a 404 or 413 that never reads the body) leaves h11 unable to reuse
the connection (hypercorn closes it, at the fix above). It would come down to a race
whether the client's next request on it got through: httpx writes a request's head and
its body separately, and a 404 could finish between the two. So before a response
starts, a small request body is waited for (drained, by Quart's receive loop that reads
the body anyway, to at most ``DRAIN_LIMIT_BYTES`` for at most ``DRAIN_TIMEOUT_S``) and the
connection is reused; a larger, chunked or late one gets ``Connection: close`` in the
response, so the client knows not to reuse it, and the connection closes after it.

The hot path (``direct_body_send``, also wrapped around every HTTP/1.1 request): a
streamed body is one write a few tokens, and hypercorn's path for each (``HTTPStream.
app_send`` -> ``H11Protocol.stream_send`` -> h11's state machine and chunk writer ->
``TCPServer.protocol_send``, its send lock and shielded ``send_all``) cost 45 us a write
where ``send_all`` alone costs 11 (``python -m tools.servicebench``, docs/results.md).
Where hypercorn would do nothing but frame the bytes as a chunk and write them (an
HTTP/1.1 response with a chunked body, in progress, its stream open, its send lock
free), a body message is framed here as h11's ``ChunkedWriter`` frames it and written
with one non-blocking ``os.write`` on the socket, with no schedule point (trio's
``send_all`` makes one of every write, which cost several times the write itself); what
the socket does not take at once goes by the same shielded ``send_all`` under the same
lock, taken without a wait, so a chunk is never cut or interleaved. Anything
else (the response's start and end, a closed stream, HTTP/1.0 or HTTP/2, a contended
lock) goes hypercorn's way. h11 keeps no count of a chunked body's bytes, so its state is
the same either way. Known for hypercorn 0.18 and h11 0.16 like the rest of this module
(it reads ``H11Protocol.stream`` and ``connection``, and h11's writer).
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
from collections.abc import Callable
from typing import Any, cast

import h11
import hypercorn.trio.run
import trio
from h11._writers import ChunkedWriter
from hypercorn.config import Config
from hypercorn.events import Closed, Event, RawData, Updated
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.protocol.http_stream import ASGIHTTPState, HTTPStream
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import (
    AppWrapper,
    ASGIReceiveCallable,
    ASGIReceiveEvent,
    ASGISendCallable,
    ASGISendEvent,
    LifespanState,
    Scope,
)
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from . import h2_protocol
from .write_blocks import write_blocked

log = logging.getLogger("streamscope.http")

# A request body this small is read rather than thrown away with its connection: a few
# TCP segments, less than a new connection costs (Go's net/http drains 256 KiB).
DRAIN_LIMIT_BYTES = 64 * 1024
# How long a response waits for such a body to arrive before it closes the connection
# instead: enough for a body already sent, short for one that is not coming.
DRAIN_TIMEOUT_S = 1.0
_HTTP1 = {"1.0", "1.1"}
# The versions this module's patches of private methods are known for: pyproject.toml's
# pins (tests/test_http_connection.py checks they agree). ``install`` refuses others.
SUPPORTED_VERSIONS = {"hypercorn": ">=0.18,<0.19", "h11": ">=0.16,<0.17"}


class UnsupportedVersion(RuntimeError):
    """hypercorn or h11 is installed in a version these fixes are not known for."""


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

        Cancellation: shielded: a cancel (the server stopping, the connection's own
        task cancelled) cannot leave the socket open; it takes no I/O wait.
        """
        with trio.CancelScope(shield=True):
            await super()._close()

    async def run(self) -> None:
        """Serve the connection; a bug in it ends it alone, never the server.

        Cancellation: propagates (the server stops).
        """
        try:
            await super().run()
        except* Exception as group:
            log.exception("a connection failed; it was closed", exc_info=group)

    async def protocol_send(self, event: Event) -> None:
        """hypercorn's send of a protocol event, with two fixes: the keep-alive timer's
        restart (``Updated``) survives a cancel, and a write that meets ``_close``'s
        send_eof (``BusyResourceError``) closes the protocol instead of failing.

        Cancellation: ``Updated`` is shielded (a lock held for no I/O: the timer is never
        left stopped by a cancel); anything else propagates as in hypercorn (a
        ``RawData`` at the socket's wait, its bytes maybe partly sent).
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


    def chunk_frame(self, body: bytes) -> bytes | None:
        """``body`` framed as a chunk of the response in progress, if hypercorn would do
        just that with it (see the module docstring); else None."""
        protocol = self.protocol.protocol
        if not body or not isinstance(protocol, H11Protocol):
            return None
        stream, connection = protocol.stream, protocol.connection
        if (not isinstance(stream, HTTPStream) or stream.closed
                or stream.state is not ASGIHTTPState.RESPONSE
                or connection.our_state is not h11.SEND_BODY
                or not isinstance(connection._writer, ChunkedWriter)):
            return None
        return b"%x\r\n%s\r\n" % (len(body), body)

    async def send_frame(self, frame: bytes) -> bool:
        """Write ``frame`` as ``protocol_send`` writes RawData, if the send lock is free;
        False, having written nothing, if it is not.

        The write is first tried as one non-blocking ``os.write`` on the socket: trio's
        ``send_all`` makes a schedule point of every write (its ``_try_sync``), and a
        trip through the scheduler, with its ``epoll_wait``, cost 15-20 us a write where
        the write itself costs 1-2 (tools/writebench.py at a0b2ba5). What the socket does
        not take at once (its buffer is full: a slow reader) goes the way it went before,
        under the lock and shielded: a chunk is never cut.

        Cancellation: none before the socket's buffer is full; then shielded.
        """
        if self.send_lock.locked():
            return False
        global direct_writes
        direct_writes += 1
        stream = self.stream
        if type(stream) is trio.SocketStream:
            try:
                written = os.write(stream.socket.fileno(), frame)
            except BlockingIOError:
                written = 0
            except OSError:  # reset, shut down, closed: as send_all's BrokenResourceError
                await self.protocol.handle(Closed())
                return True
            if written == len(frame):
                return True
            global partial_writes
            partial_writes += 1
            frame = frame[written:]
            write_blocked()  # the client does not take the bytes: not waited for
        self.send_lock.acquire_nowait()
        try:
            with trio.CancelScope(shield=True):
                await stream.send_all(frame)
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError):
            await self.protocol.handle(Closed())  # as protocol_send, and its fix above
        finally:
            self.send_lock.release()
        return True


# Body messages written by the hot path, and of them those the socket took only part of at
# once (the rest went by send_all), for tests and benchmarks (process-wide).
direct_writes = 0
partial_writes = 0


def direct_body_send(
    server: ClosingTCPServer, scope: dict[str, Any], send: ASGISendCallable
) -> ASGISendCallable:
    """``send`` with the hot path of the module docstring for an HTTP/1.1 request."""
    if scope.get("type") != "http" or scope.get("http_version") != "1.1":
        return send

    async def body_send(message: ASGISendEvent) -> None:
        """One body message: on the hot path when it can go there, else ``send``.

        Cancellation: as ``send_frame``'s (none before the socket is full, then
        shielded: a chunk is never cut), or as ``send``'s.
        """
        if message["type"] == "http.response.body" and message.get("more_body", False):
            frame = server.chunk_frame(bytes(message.get("body", b"")))
            if frame is not None and await server.send_frame(frame):
                return
        await send(message)

    return body_send


def install() -> None:
    """Make hypercorn's trio worker (the CLI's ``-k trio`` and ``hypercorn.trio.serve``)
    build ``ClosingTCPServer``s: ``worker_serve`` looks ``TCPServer`` up when it runs;
    and ``h2_protocol.GuardedH2Protocol`` for HTTP/2 (``h2_protocol.install``). Idempotent.

    Raises:
        UnsupportedVersion: hypercorn or h11 is outside ``SUPPORTED_VERSIONS`` (the
            patches reach into their private methods); nothing was patched.
    """
    check_versions()
    hypercorn.trio.run.TCPServer = ClosingTCPServer  # type: ignore[misc]
    h2_protocol.install()  # and its HTTP/2 connections: floods bounded, GOAWAY on drain


def check_versions(installed: Callable[[str], str] | None = None) -> None:
    """Raise UnsupportedVersion, naming the supported range, unless every package of
    ``SUPPORTED_VERSIONS`` is installed within it (``installed(name)``: its version;
    default ``importlib.metadata.version``)."""
    version_of = installed or importlib.metadata.version
    for name, supported in SUPPORTED_VERSIONS.items():
        try:
            found = version_of(name)
            ok = SpecifierSet(supported).contains(Version(found), prereleases=True)
        except importlib.metadata.PackageNotFoundError:
            found, ok = "(no version: not installed as a distribution)", False
        except InvalidVersion:
            ok = False
        if not ok:
            raise UnsupportedVersion(
                f"{name} {found} is installed, but app/edge/http_fixes.py patches private "
                f"methods of hypercorn and h11 known for {name}{supported} only (the pins in "
                f"pyproject.toml): install '{name}{supported}', or check the fixes against "
                f"this {name} (tests/test_http_connection.py) and move the pins")


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
        """``receive``, noting the body's end. Cancellation: as ``receive``'s (nothing
        taken is lost: the message is returned with no checkpoint after it)."""
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            body_done.set()  # the body's end, or a disconnect: nothing more will come
        return message

    async def settled_send(message: ASGISendEvent) -> None:
        """Cancellation: while waiting for the body, propagates; nothing was sent."""
        if message["type"] == "http.response.start" and not body_done.is_set():
            if declared is not None and declared <= DRAIN_LIMIT_BYTES:
                with trio.move_on_after(DRAIN_TIMEOUT_S):
                    await body_done.wait()
            if not body_done.is_set():
                headers = [*message.get("headers", []), (b"connection", b"close")]
                message = cast(ASGISendEvent, {**message, "headers": headers})
        await send(message)

    return watched_receive, settled_send


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

        Cancellation: propagates into the app (quart-trio's request nursery); nothing
        of the wrappers is left (they hold no resource).
        """
        plain = cast(dict[str, Any], scope)
        receive, send = settle_request_body(plain, receive, send)
        send = direct_body_send(self.server, plain, send)
        await self.app(scope, receive, send, sync_spawn, call_soon)


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
