"""hypercorn's HTTP/2 connection, guarded: ``GuardedH2Protocol``, and ``install``.

Known for hypercorn 0.18 with h2 4 (it overrides ``H2Protocol``'s private
``_handle_events`` and reads its ``connection``, ``streams`` and ``_flush``;
``hypercorn_patches.check_versions`` holds the hypercorn pin). ``install`` makes hypercorn's
``ProtocolWrapper`` build ``GuardedH2Protocol`` for every HTTP/2 connection (ALPN ``h2``
under TLS, prior knowledge or an ``h2c`` upgrade in the clear), and a
``h2_flow.FlowBuffer`` for each of its streams (per-stream backpressure).

Floods. Each read is parsed ``h2_floods.SLICE_BYTES`` at a time, and each slice's events
are judged by the connection's ``h2_floods.FloodBudgets`` before any of them is handled:
past a budget, nothing of the slice is started and the client gets ``GOAWAY``
``ENHANCE_YOUR_CALM``. Streams reset in the read that opened them are never started
(see ``h2_floods``). A connection error h2 finds (a CONTINUATION flood's among them) is
hung up the same way: its GOAWAY, then the close once the client had time to read it.

Retiring: a GOAWAY when the server drains, or after ``keep_alive_max_requests``.
``h2_retire.goaway_on_drain`` (beside hypercorn under ``streamscope serve``, in the app
under ``hypercorn -k trio app:app``) retires every HTTP/2 connection of a server once its
runtime drains (and each one made during the drain, once it started a stream): a
connection with no stream running gets ``GOAWAY`` (``NO_ERROR``) and is closed at once;
one with streams running keeps serving them, and new requests on it are answered as over
HTTP/1.1 during a drain (503 ``shutdown``, ``Retry-After``), until its last stream has
ended: then the GOAWAY and the close. Why not the GOAWAY at once, as RFC 9113 allows with
streams still running: the ``h2`` library, under httpx and so under the OpenAI SDK over
HTTP/2, closes its side of the connection on any GOAWAY and fails every stream still on
it (python-hyper/h2#1181, open): a drain would cut those streams off, which it promises
not to. The same retirement replaces hypercorn's own at ``keep_alive_max_requests`` (an
h2 ``close_connection`` in the middle of whatever ran on the connection: every stream on
it was cut off with no final event); a request past that count gets ``RST_STREAM``
``REFUSED_STREAM`` (not processed: the client may retry it elsewhere). And when hypercorn
itself closes a connection because it stops (its ``terminated`` Event: an idle connection
at once, before the drain may have been seen), the GOAWAY goes out first.

Cancellation, in general: hypercorn runs ``handle`` in the connection's reading task and
``stream_send`` in each stream's task; a cancel there means the connection or the stream
is ending, so the work it cuts has nothing to undo, and what must still happen then (the
close, the last GOAWAY) is finished first: shielded, and with no I/O wait.
"""

from __future__ import annotations

import contextlib
import logging
import select
from collections.abc import Sequence
from typing import Any

import h2.errors
import h2.events
import h2.exceptions
import hypercorn.protocol
import hypercorn.protocol.h2
import trio
from hypercorn.events import Closed, Event, RawData
from hypercorn.protocol.events import Event as StreamEvent
from hypercorn.protocol.events import StreamClosed
from hypercorn.protocol.h2 import H2Protocol

from . import h2_floods, h2_retire
from .h2_flow import FlowBuffer

log = logging.getLogger("streamscope.http")

# After the last GOAWAY, how long the socket stays open for it to be read, and how much
# of what the client sends meanwhile is read and thrown away (each byte is decrypted: a
# flood's client goes on sending): see GuardedH2Protocol._hang_up.
LINGER_S = 1.0
LINGER_BYTES = 256 * 1024


class GuardedH2Protocol(H2Protocol):
    """hypercorn's HTTP/2 connection with flood budgets, and a GOAWAY once it retires
    (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """hypercorn's override: the connection, its budgets, registered for the drain.
        Sync."""
        super().__init__(*args, **kwargs)
        self.budgets = h2_floods.FloodBudgets(trio.current_time())
        self.flooded: str | None = None  # the frame whose budget ran out: cut off
        self.retiring: str | None = None  # why it ends once its streams have: see retire
        self.hung_up = False  # our last GOAWAY went out: what comes in is not parsed
        self.stillborn = 0  # streams reset in the read that opened them, never started
        self.last_started = 0  # the highest stream id started: a GOAWAY's last stream
        self._peer_closed = trio.Event()  # once hung up: the client closed its side
        self._lingered = 0  # bytes thrown away since
        self._ended = False  # Closed was handled
        h2_retire.register(self.config, self)

    async def handle(self, event: Event) -> None:
        """What the socket brought (hypercorn's override): after our last GOAWAY it is
        thrown away; a large read is parsed in slices; the connection's end is ours.

        Cancellation: nothing to undo: the connection's reading task is being cancelled
        (the connection ends), so a read is parsed only up to the slice it reached; the
        end itself (``Closed``) is finished first (shielded).
        """
        if isinstance(event, RawData) and self.hung_up:
            self._lingered += len(event.data)
            if not event.data or self._lingered > LINGER_BYTES:  # its EOF, or a flood's
                self._peer_closed.set()
            return  # h2 would refuse anything but a GOAWAY now, and close at once
        if isinstance(event, Closed):
            await self._handle_closed()
            return
        if isinstance(event, RawData) and len(event.data) > h2_floods.SLICE_BYTES:
            await self._handle_in_slices(event.data)
            return
        if isinstance(event, RawData):
            await self._receive(event.data)
            return
        await super().handle(event)

    async def _handle_closed(self) -> None:
        """The connection ended (the client's EOF or a reset, a failed write, or the
        server closing it): every stream sees a disconnect; and the socket is closed now.

        hypercorn's ``H2Protocol`` closed its streams but not the socket: after a
        client's FIN the server kept it open until the keep-alive timer fired (5 s by
        default, 15 under ``streamscope serve``), where HTTP/1.1 closes at once.

        Cancellation: finished first (shielded, no I/O wait: a frame is written only if
        the socket takes it at once): it runs where a connection ends, cancelled or not,
        and a socket left open would hold the client until its keep-alive timer.
        """
        self._peer_closed.set()
        h2_retire.forget(self.config, self)
        first = not self._ended
        self._ended = True
        with trio.CancelScope(shield=True):
            if (first and not self.hung_up and self.context.terminated.is_set()
                    and self._socket_takes_a_frame()):
                await self._goaway(h2.errors.ErrorCodes.NO_ERROR, "the server is stopping")
            await super().handle(Closed())
            if first and not self.hung_up:  # hung up: _close_after_linger closes it
                await self.send(Closed())  # TCPServer: close the socket, then this again

    def _socket_takes_a_frame(self) -> bool:
        """Whether the socket takes a small write now, without waiting. A write here
        would be shielded (hypercorn's), so a client that reads nothing could hold the
        server's stop for as long as it liked. False where the socket is not found."""
        stream = getattr(getattr(self.send, "__self__", None), "stream", None)
        sock = getattr(getattr(stream, "transport_stream", stream), "socket", None)
        if sock is None or sock.fileno() < 0:
            return False
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLOUT)
        return bool(poller.poll(0))

    async def _handle_in_slices(self, data: bytes) -> None:
        """Parse a read a slice at a time, with a schedule point between: a flood's read
        (64 KiB of small frames: thousands) is parsed only up to the slice where its
        budget ran out, and never holds the event loop for longer than a slice.

        Cancellation: nothing to undo: it lands between slices (the connection is being
        closed, so the slices left would be answered by nobody); ``_handle_closed``,
        shielded, ends every stream.
        """
        size = h2_floods.SLICE_BYTES
        for start in range(0, len(data), size):
            if start:
                await trio.lowlevel.checkpoint()
            if self.hung_up or self.closed:
                return
            await self._receive(data[start:start + size])

    async def _receive(self, data: bytes) -> None:
        """Parse ``data`` and handle its events, as hypercorn's ``handle`` does; but a
        connection error (h2's ``ProtocolError``: a CONTINUATION flood past h2's
        ``CONTINUATION_BACKLOG``, a malformed frame) is hung up like a flood. hypercorn
        closed the socket at once, and with the client's bytes unread the kernel's RST
        could drop the GOAWAY that h2 had queued: the client would not learn why.

        Cancellation: nothing to undo: the parse is synchronous; a cancel lands in the
        handling of its events, where the connection's task is being cancelled and the
        events after the one it reached are not handled (``_handle_closed`` gives every
        stream its disconnect).
        """
        try:
            events = self.connection.receive_data(data)
        except h2.exceptions.ProtocolError as error:
            log.info("HTTP/2 connection from %s: %s; GOAWAY, closed", self.client, error)
            code = getattr(error, "error_code", h2.errors.ErrorCodes.PROTOCOL_ERROR)
            await self._hang_up(code, str(error))
            return
        await self._handle_events(events)

    async def _handle_events(self, events: list[h2.events.Event]) -> None:
        """One slice's events (hypercorn's override): judged by the budgets first; those
        of streams never to start left out; then the retirement checked.

        Cancellation: nothing to undo: it lands in hypercorn's handling (a stream's start,
        a write) only when the connection is ending, so the events after the one it
        reached need no answer; ``_handle_closed`` gives every stream its disconnect.
        """
        flooded = self.budgets.judge(events, trio.current_time())
        if flooded is not None:
            # Nothing of this read is started; the answers h2 has queued for it (an ACK
            # for every PING and SETTINGS) are not sent.
            self.connection.clear_outbound_data_buffer()
            await self._cut_off(flooded)
            return
        await super()._handle_events(self._triage(events))
        if self.retiring is None and h2_retire.is_draining(self.config) and self.last_started:
            self.retiring = "drain"  # made during the drain: once its request is answered
        if self.retiring is None and (
                self.keep_alive_requests >= self.config.keep_alive_max_requests):
            self.retiring = "keep_alive_max_requests"
        await self._close_if_done()

    def _triage(self, events: Sequence[h2.events.Event]) -> list[h2.events.Event]:
        """``events`` less those of streams never to start: reset in this same read
        (stillborn), past ``keep_alive_max_requests`` (refused), or already gone. Their
        DATA still counts against the connection's window, which is handed back."""
        reset_now = {e.stream_id for e in events if h2_floods.is_reset(e)}
        opened: set[int] = set()  # streams this read starts
        skipped: set[int] = set()
        kept: list[h2.events.Event] = []
        for event in events:
            stream_id = getattr(event, "stream_id", None)
            if isinstance(event, h2.events.RequestReceived):
                if stream_id in reset_now:
                    self.stillborn += 1
                    skipped.add(event.stream_id)
                    continue
                if (self.keep_alive_requests + len(opened)
                        >= self.config.keep_alive_max_requests):
                    self._refuse(event.stream_id)
                    skipped.add(event.stream_id)
                    continue
                opened.add(event.stream_id)
            elif stream_id in skipped or (isinstance(event, h2.events.DataReceived)
                                          and stream_id not in self.streams
                                          and stream_id not in opened):
                # hypercorn looks a DATA frame's stream up without a guard: the body of a
                # stream it has closed (a response sent before its body came) would raise.
                if isinstance(event, h2.events.DataReceived):
                    self.connection.acknowledge_received_data(
                        event.flow_controlled_length, event.stream_id)
                continue
            kept.append(event)
        return kept

    async def _create_stream(self, request: h2.events.RequestReceived) -> None:
        """A stream's start (hypercorn's override), its id noted for the GOAWAY.

        Cancellation: nothing to undo: the id is noted before the only await (hypercorn's
        start of the stream's task), so a GOAWAY names it whether or not it started.
        """
        if request.stream_id % 2:  # the client's (an h2c upgrade's stream 1 comes here too)
            self.last_started = max(self.last_started, request.stream_id)
        await super()._create_stream(request)

    def _refuse(self, stream_id: int) -> None:
        """RST_STREAM REFUSED_STREAM: not processed, the client may retry it elsewhere."""
        with contextlib.suppress(h2.exceptions.ProtocolError):  # h2 closed it already
            self.connection.reset_stream(stream_id, h2.errors.ErrorCodes.REFUSED_STREAM)

    async def _cut_off(self, frame: str) -> None:
        """GOAWAY (ENHANCE_YOUR_CALM); every stream sees a disconnect at once.

        Cancellation: the connection's task is being cancelled: the GOAWAY's write or a
        stream's close is given up, and ``_handle_closed``, shielded (finished first),
        gives every stream left its disconnect and closes the socket.
        """
        self.flooded = frame
        log.warning("HTTP/2 connection from %s: too many %s frames (%d streams started, "
                    "%d reset before they started); GOAWAY (ENHANCE_YOUR_CALM), closed",
                    self.client, frame, self.keep_alive_requests, self.stillborn)
        await self._hang_up(h2.errors.ErrorCodes.ENHANCE_YOUR_CALM,
                            f"too many {frame} frames")

    def retire(self, why: str) -> None:
        """End this connection once its running streams have ended (see the module
        docstring): a GOAWAY then, and the close. Sync; idempotent."""
        if self.retiring is None:
            self.retiring = why
        if not self.streams:
            self.task_group.spawn(self._close_if_done)

    async def stream_send(self, event: StreamEvent) -> None:
        """A stream's event to the client (hypercorn's override); after a stream's last,
        the retirement's close if it was the last stream.

        Cancellation: nothing to undo at hypercorn's send (the stream's task is being
        cancelled: its buffer is closed with the stream); the retirement's close after
        it is finished first (shielded).
        """
        await super().stream_send(event)
        if isinstance(event, StreamClosed):
            await self._close_if_done()

    async def _close_if_done(self) -> None:
        """Cancellation: finished first (shielded): it often runs in a stream's last
        task, cancelled already, and the GOAWAY must still go out."""
        if self.retiring is None or self.streams or self.hung_up or self.closed:
            return
        with trio.CancelScope(shield=True):
            await self._hang_up(h2.errors.ErrorCodes.NO_ERROR, self.retiring)

    async def _hang_up(self, error_code: h2.errors.ErrorCodes, why: str) -> None:
        """Send the GOAWAY; every stream left sees a disconnect now; the socket closes
        when the client has closed its side, or ``LINGER_S`` or ``LINGER_BYTES`` later.

        The linger is so that the GOAWAY reaches the client: closing a socket with
        unread bytes in it (a flood's, or a request sent before the client read the
        GOAWAY) makes the kernel send an RST, and the client's kernel may then drop the
        GOAWAY before it was read. What the client sends meanwhile is thrown away.

        Cancellation: nothing to undo at the GOAWAY's write or a stream's close: the
        connection's task is being cancelled, and ``_handle_closed``, finished first
        (shielded), gives every stream left its disconnect and closes the socket.
        """
        await self._goaway(error_code, why)
        await H2Protocol.handle(self, Closed())  # the streams' disconnects, not the socket's
        self.task_group.spawn(self._close_after_linger)

    async def _goaway(self, error_code: h2.errors.ErrorCodes, why: str) -> None:
        """Cancellation: nothing to undo: ``hung_up`` is set and h2 has the GOAWAY queued
        before the write, the only await, where a cancel means the connection is
        ending."""
        self.hung_up = True
        with contextlib.suppress(h2.exceptions.ProtocolError):  # h2 has closed already
            self.connection.close_connection(error_code=error_code,
                                             additional_data=why.encode(),
                                             last_stream_id=self.last_started)
        await self._flush()

    async def _close_after_linger(self) -> None:
        """Cancellation: nothing to undo: the linger only waits; a cancel means the
        connection's task group is ending, and with it the socket."""
        with trio.move_on_after(LINGER_S):
            await self._peer_closed.wait()
        await self.send(Closed())


def install() -> None:
    """Make hypercorn build ``GuardedH2Protocol`` for HTTP/2 (``ProtocolWrapper`` looks
    ``H2Protocol`` up in ``hypercorn.protocol`` when a connection starts) and a
    ``FlowBuffer`` for each of its streams (``_create_stream`` looks ``StreamBuffer`` up
    in ``hypercorn.protocol.h2``). Idempotent; ``hypercorn_patches.install`` calls it, after
    checking hypercorn's version."""
    hypercorn.protocol.H2Protocol = GuardedH2Protocol  # type: ignore[misc]
    hypercorn.protocol.h2.StreamBuffer = FlowBuffer  # type: ignore[misc]
