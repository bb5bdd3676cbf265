"""Fixes at hypercorn's HTTP/2 edge: per-stream backpressure, floods bounded, a GOAWAY
when the server drains.

Known for hypercorn 0.18 with h2 4 (it overrides ``H2Protocol``'s private
``_handle_events`` and reads its ``connection``, ``streams`` and ``_flush``;
``http_fixes.check_versions`` holds the hypercorn pin). ``install`` makes hypercorn's
``ProtocolWrapper`` build ``GuardedH2Protocol`` for every HTTP/2 connection: ALPN ``h2``
under TLS, prior knowledge or an ``h2c`` upgrade in the clear.

Backpressure. HTTP/2's flow control is per stream: hypercorn sends a stream's DATA as
its window allows and holds the rest in the stream's ``StreamBuffer``, whose ``push``
(the app's write) is to wait above ``BUFFER_HIGH_WATER`` (32 KiB) until ``pop`` (the
sending task) drains it. But ``pop`` releases the writer whenever the chunk it took was
under the low-water mark, and with the window shut the chunk is empty: every attempt to
send wakes the writer, with nothing sent. So a reader that stops sending WINDOW_UPDATEs
for one stream never holds up its writer: hypercorn buffers the whole answer in memory,
the hub never sees a slow reader, and no policy applies (a probe: a stream whose window
stayed shut ran to its 400th token, all of it buffered). ``FlowBuffer`` releases the
writer on what has drained (the buffer under the low-water mark), which makes the app's
write wait, for that stream only, as a full socket makes it wait over HTTP/1.1. No
pgjones/hypercorn issue was found for it; the fork anycorn fixed the same ``pop``
(davidbrochart/anycorn#61). Drop ``FlowBuffer`` when hypercorn's ``pop`` does that, and
check ``tests/test_http2_backpressure.py`` still passes without it.

Floods (CVE-2023-44487, "rapid reset", and its kin). hypercorn's mitigation
(pgjones/hypercorn#146, closed by its commit 926c430) is ``keep_alive_max_requests``:
after 1,000 requests a connection is closed. That bounds nothing per second: a client
that opens and resets streams in a loop makes the server start a request (a task, the
route, a prompt's encode, sometimes the engine's admission) for every one of its 1,000,
and then opens another connection (issue 25's probe put 33 of 300 such streams into the
engine; one that reset each stream 10 ms after opening it, all 300). And hypercorn
answers every PING and SETTINGS frame whatever their number. So each
connection here has three budgets (``FloodBudget``: a token bucket; a burst, refilled at a
rate): client ``RST_STREAM``s, ``PING``s and ``SETTINGS`` frames. A frame past its
budget gets ``GOAWAY`` with ``ENHANCE_YOUR_CALM`` and the connection is closed: its
streams see a disconnect, so their sequences are cancelled like any client's that left.
A stream that its client reset in the same read that opened it ("stillborn") is never
started at all: hypercorn would start its request only to cancel it a moment later; and
such streams have a budget of their own, far smaller, since a real client seldom
cancels a request before the server could have read it: a rapid-reset connection is cut
off within its first slice, before its hundredth reset is parsed (an attacker that
connects again at once made the server parse 100 triples per connection, 40 connections
a second: ``tools.lab rapidreset``'s ``reconnect``). And
a read is parsed ``SLICE_BYTES`` at a time: h2 parses all of what it is given before
anyone can count, and 64 KiB of a flood's small frames held the event loop for tens of
milliseconds, every other client's stream with it.

The defaults are far above what a browser or an SDK does (a page that closes all of its
``EventSource``s resets a few dozen streams at once; keep-alive PINGs come seconds apart)
and far below a flood's rate. What a flood can still make this server start, per
connection, is at most ``RESET_BURST`` plus ``RESETS_PER_S`` a second plus the streams
it holds open (``h2_max_concurrent_streams``).

Retiring: a GOAWAY when the server drains, or after ``keep_alive_max_requests``.
``h2_retire.goaway_on_drain`` (beside hypercorn under ``streamscope serve``, in the app
under ``hypercorn -k trio app:app``) retires every HTTP/2 connection of a server once its
runtime drains (and each one made during the drain, once it started a stream): a
connection with no stream running gets
``GOAWAY`` (``NO_ERROR``) and is closed at once; one with streams running keeps serving
them, and new requests on it are answered as over HTTP/1.1 during a drain (503
``shutdown``, ``Retry-After``), until its last stream has ended: then the GOAWAY and the
close. Why not the GOAWAY at once, as RFC 9113 allows with streams still running: the
``h2`` library, under httpx and so under the OpenAI SDK over HTTP/2, closes its side of
the connection on any GOAWAY and fails every stream still on it
(python-hyper/h2#1181, open): a drain would cut those streams off, which it promises
not to. The same retirement replaces hypercorn's own at ``keep_alive_max_requests``
(an h2 ``close_connection`` in the middle of whatever ran on the connection: every stream
on it was cut off with no final event); a request past that count gets
``RST_STREAM`` ``REFUSED_STREAM`` (not processed: the client may retry it elsewhere).
And when hypercorn itself closes a connection because it stops (its ``terminated``
Event: an idle connection at once, before the drain may have been seen), the GOAWAY goes
out first.
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
from hypercorn.protocol.h2 import (
    BUFFER_HIGH_WATER,
    BUFFER_LOW_WATER,
    BufferCompleteError,
    H2Protocol,
    StreamBuffer,
)

from . import h2_retire
from .write_blocks import write_blocked

log = logging.getLogger("streamscope.http")

# Client RST_STREAMs a connection may send at once, and per second after that.
RESET_BURST = 100
RESETS_PER_S = 10.0
# Of those, of streams reset in the read that opened them (never started).
STILLBORN_BURST = 16
STILLBORN_PER_S = 2.0
# PING frames: keep-alive pings come seconds apart.
PING_BURST = 50
PINGS_PER_S = 5.0
# SETTINGS frames: a client sends one or two.
SETTINGS_BURST = 20
SETTINGS_PER_S = 2.0
# What one parse of h2 takes at most (see GuardedH2Protocol._handle_in_slices): a
# request's head and a few frames; a quarter of a default frame.
SLICE_BYTES = 1024
# After the last GOAWAY, how long the socket stays open for it to be read, and how much
# of what the client sends meanwhile is read and thrown away (each byte is decrypted: a
# flood's client goes on sending): see GuardedH2Protocol._hang_up.
LINGER_S = 1.0
LINGER_BYTES = 256 * 1024

class FlowBuffer(StreamBuffer):
    """hypercorn's stream buffer whose writer waits until what it wrote has drained
    (see the module docstring)."""

    async def push(self, data: bytes) -> None:
        """Cancellation: the data is buffered; the wait for the drain is given up."""
        if self._complete:
            raise BufferCompleteError()
        self.buffer.extend(data)
        await self._is_empty.clear()
        if len(self.buffer) >= BUFFER_HIGH_WATER:
            write_blocked()  # the window is shut: the hub no longer waits for it
        while len(self.buffer) >= BUFFER_HIGH_WATER:  # ``close`` empties it
            await self._paused.clear()
            await self._paused.wait()

    async def pop(self, max_length: int) -> bytes:
        data = bytes(self.buffer[:max_length])
        del self.buffer[:max_length]
        if len(self.buffer) < BUFFER_LOW_WATER:
            await self._paused.set()
        if not self.buffer:
            await self._is_empty.set()
        return data


class FloodBudget:
    """A token bucket: ``burst`` at once, refilled at ``per_s`` a second up to ``burst``."""

    def __init__(self, burst: int, per_s: float, now: float) -> None:
        self.burst, self.per_s = burst, per_s
        self.tokens = float(burst)
        self.at = now

    def spend(self, now: float) -> bool:
        """Take one token at time ``now``; False when none is left."""
        self.tokens = min(float(self.burst), self.tokens + (now - self.at) * self.per_s)
        self.at = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True


class GuardedH2Protocol(H2Protocol):
    """hypercorn's HTTP/2 connection with flood budgets, and a GOAWAY once it retires
    (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        now = trio.current_time()
        self.budgets = {
            "RST_STREAM": FloodBudget(RESET_BURST, RESETS_PER_S, now),
            "stillborn RST_STREAM": FloodBudget(STILLBORN_BURST, STILLBORN_PER_S, now),
            "PING": FloodBudget(PING_BURST, PINGS_PER_S, now),
            "SETTINGS": FloodBudget(SETTINGS_BURST, SETTINGS_PER_S, now),
        }
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
        if isinstance(event, RawData) and self.hung_up:
            self._lingered += len(event.data)
            if not event.data or self._lingered > LINGER_BYTES:  # its EOF, or a flood's
                self._peer_closed.set()
            return  # h2 would refuse anything but a GOAWAY now, and close at once
        if isinstance(event, Closed):
            await self._handle_closed()
            return
        if isinstance(event, RawData) and len(event.data) > SLICE_BYTES:
            await self._handle_in_slices(event.data)
            return
        await super().handle(event)

    async def _handle_closed(self) -> None:
        """The connection ended (the client's EOF or a reset, a failed write, or the
        server closing it): every stream sees a disconnect; and the socket is closed now.

        hypercorn's ``H2Protocol`` closed its streams but not the socket: after a
        client's FIN the server kept it open until the keep-alive timer fired (5 s by
        default, 15 under ``streamscope serve``), where HTTP/1.1 closes at once.

        Cancellation: none (shielded): it runs where a connection ends, cancelled or not.
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

        Cancellation: propagates between slices (the connection is being closed).
        """
        for start in range(0, len(data), SLICE_BYTES):
            if start:
                await trio.lowlevel.checkpoint()
            if self.hung_up or self.closed:
                return
            await super().handle(RawData(data=data[start:start + SLICE_BYTES]))

    async def _handle_events(self, events: list[h2.events.Event]) -> None:
        flooded = self._judge(events)
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

    def _judge(self, events: Sequence[h2.events.Event]) -> str | None:
        """The frame whose budget ``events`` exceed, if any."""
        now = trio.current_time()
        opened = {e.stream_id for e in events if isinstance(e, h2.events.RequestReceived)}
        for event in events:
            if isinstance(event, h2.events.StreamReset) and event.remote_reset:
                if event.stream_id in opened and not self.budgets[
                        "stillborn RST_STREAM"].spend(now):
                    return "stillborn RST_STREAM"
                frame = "RST_STREAM"
            elif isinstance(event, h2.events.PingReceived):
                frame = "PING"
            elif isinstance(event, h2.events.RemoteSettingsChanged):
                frame = "SETTINGS"
            else:
                continue
            if not self.budgets[frame].spend(now):
                return frame
        return None

    def _triage(self, events: Sequence[h2.events.Event]) -> list[h2.events.Event]:
        """``events`` less those of streams never to start: reset in this same read
        (stillborn), past ``keep_alive_max_requests`` (refused), or already gone. Their
        DATA still counts against the connection's window, which is handed back."""
        reset_now = {e.stream_id for e in events
                     if isinstance(e, h2.events.StreamReset) and e.remote_reset}
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
        if request.stream_id % 2:  # the client's (an h2c upgrade's stream 1 comes here too)
            self.last_started = max(self.last_started, request.stream_id)
        await super()._create_stream(request)

    def _refuse(self, stream_id: int) -> None:
        """RST_STREAM REFUSED_STREAM: not processed, the client may retry it elsewhere."""
        with contextlib.suppress(h2.exceptions.ProtocolError):  # h2 closed it already
            self.connection.reset_stream(stream_id, h2.errors.ErrorCodes.REFUSED_STREAM)

    async def _cut_off(self, frame: str) -> None:
        """GOAWAY (ENHANCE_YOUR_CALM); every stream sees a disconnect at once."""
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
        await super().stream_send(event)
        if isinstance(event, StreamClosed):
            await self._close_if_done()

    async def _close_if_done(self) -> None:
        """Cancellation: none (often in a stream's last task, cancelled already)."""
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
        """
        await self._goaway(error_code, why)
        await H2Protocol.handle(self, Closed())  # the streams' disconnects, not the socket's
        self.task_group.spawn(self._close_after_linger)

    async def _goaway(self, error_code: h2.errors.ErrorCodes, why: str) -> None:
        self.hung_up = True
        with contextlib.suppress(h2.exceptions.ProtocolError):  # h2 has closed already
            self.connection.close_connection(error_code=error_code,
                                             additional_data=why.encode(),
                                             last_stream_id=self.last_started)
        await self._flush()

    async def _close_after_linger(self) -> None:
        """Cancellation: the connection is ending anyway (its task group is cancelled)."""
        with trio.move_on_after(LINGER_S):
            await self._peer_closed.wait()
        await self.send(Closed())


def install() -> None:
    """Make hypercorn build ``GuardedH2Protocol`` for HTTP/2 (``ProtocolWrapper`` looks
    ``H2Protocol`` up in ``hypercorn.protocol`` when a connection starts) and a
    ``FlowBuffer`` for each of its streams (``_create_stream`` looks ``StreamBuffer`` up
    in ``hypercorn.protocol.h2``). Idempotent; ``http_fixes.install`` calls it, after
    checking hypercorn's version."""
    hypercorn.protocol.H2Protocol = GuardedH2Protocol  # type: ignore[misc]
    hypercorn.protocol.h2.StreamBuffer = FlowBuffer  # type: ignore[misc]
