"""A streamed body's chunk written straight to the socket, past hypercorn's per-write path.

Ours, a cost rather than an upstream bug (``closing_server.ClosingTCPServer`` wraps
``direct_body_send`` around the app for every HTTP/1.1 request): a streamed body is one
write a few tokens, and hypercorn's path for each (``HTTPStream.app_send`` ->
``H11Protocol.stream_send`` -> h11's state machine and chunk writer ->
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
the same either way. Known for hypercorn 0.18 and h11 0.16 (it reads ``H11Protocol.stream``
and ``connection``, and h11's writer; ``hypercorn_patches`` holds the pins).
"""

from __future__ import annotations

import os
from typing import Any

import h11
import trio
from h11._writers import ChunkedWriter
from hypercorn.events import Closed
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.protocol.http_stream import ASGIHTTPState, HTTPStream
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.typing import ASGISendCallable, ASGISendEvent

from .write_blocks import write_blocked

# Body messages written by the hot path, and of them those the socket took only part of at
# once (the rest went by send_all), for tests and benchmarks (process-wide).
direct_writes = 0
partial_writes = 0


def direct_body_send(
    server: TCPServer, scope: dict[str, Any], send: ASGISendCallable
) -> ASGISendCallable:
    """``send`` with the hot path of the module docstring for an HTTP/1.1 request served
    by ``server``."""
    if scope.get("type") != "http" or scope.get("http_version") != "1.1":
        return send

    async def body_send(message: ASGISendEvent) -> None:
        """One body message: on the hot path when it can go there, else ``send``.

        Cancellation: on the hot path, ``send_frame``'s: nothing to undo before the
        socket is full, then finished first (shielded: a chunk is never cut); off it,
        hypercorn's ``send``, whose socket write is shielded too.
        """
        if message["type"] == "http.response.body" and message.get("more_body", False):
            frame = chunk_frame(server, bytes(message.get("body", b"")))
            if frame is not None and await send_frame(server, frame):
                return
        await send(message)

    return body_send


def chunk_frame(server: TCPServer, body: bytes) -> bytes | None:
    """``body`` framed as a chunk of ``server``'s response in progress, if hypercorn would
    do just that with it (see the module docstring); else None."""
    protocol = server.protocol.protocol
    if not body or not isinstance(protocol, H11Protocol):
        return None
    stream, connection = protocol.stream, protocol.connection
    if (not isinstance(stream, HTTPStream) or stream.closed
            or stream.state is not ASGIHTTPState.RESPONSE
            or connection.our_state is not h11.SEND_BODY
            or not isinstance(connection._writer, ChunkedWriter)):
        return None
    return b"%x\r\n%s\r\n" % (len(body), body)


async def send_frame(server: TCPServer, frame: bytes) -> bool:
    """Write ``frame`` as ``server.protocol_send`` writes RawData, if the send lock is
    free; False, having written nothing, if it is not.

    The write is first tried as one non-blocking ``os.write`` on the socket: trio's
    ``send_all`` makes a schedule point of every write (its ``_try_sync``), and a
    trip through the scheduler, with its ``epoll_wait``, cost 15-20 us a write where
    the write itself costs 1-2 (tools/writebench.py at a0b2ba5). What the socket does
    not take at once (its buffer is full: a slow reader) goes the way it went before,
    under the lock and shielded: a chunk is never cut.

    Cancellation: nothing to undo before the socket's buffer is full (the non-blocking
    write has no checkpoint); then finished first: the rest is written under the lock,
    shielded, so a chunk is never cut; a reader that does not read holds that write,
    not the hub (the slow-reader policy bounds it).
    """
    if server.send_lock.locked():
        return False
    global direct_writes
    direct_writes += 1
    stream = server.stream
    if type(stream) is trio.SocketStream:
        try:
            written = os.write(stream.socket.fileno(), frame)
        except BlockingIOError:
            written = 0
        except OSError:  # reset, shut down, closed: as send_all's BrokenResourceError
            await server.protocol.handle(Closed())
            return True
        if written == len(frame):
            return True
        global partial_writes
        partial_writes += 1
        frame = frame[written:]
        write_blocked()  # the client does not take the bytes: not waited for
    server.send_lock.acquire_nowait()
    try:
        with trio.CancelScope(shield=True):
            await stream.send_all(frame)
    except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError):
        # As ``protocol_send``, with closing_server's fix (a write that meets ``_close``'s
        # send_eof: the connection is closing).
        await server.protocol.handle(Closed())
    finally:
        server.send_lock.release()
    return True
