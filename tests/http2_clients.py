"""HTTP/2 clients for the tests: httpx over TLS (``h2_client``) and a raw HTTP/2 client
(the ``h2`` library on a Trio TLS stream), against the app that
``http_server.open_servers(..., certificate)`` serves over TLS (certificates: ``tls.py``).

``H2Client`` speaks HTTP/2 frame by frame where httpx cannot: it resets one stream
(``RST_STREAM``), withholds one stream's ``WINDOW_UPDATE``s (a reader that stops reading
that stream only), ends the TCP connection with a FIN or an RST, and records the
server's ``GOAWAY``. It grants its connection-level window once, hugely, at
the start, so only the per-stream windows ever limit the server.
"""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import httpx
import trio
from hyperframe.frame import WindowUpdateFrame

from streams import ServerSentEvent, SSEParser
from tests.http_server import SETTLE_TIMEOUT_S, RunningServer
from tests.tls import Certificate

# A safety net only (every read waits for a condition), so generous: a 480-token stream
# over TLS takes 3.4 s here alone, and a test must pass on a machine 5x slower, or
# beside the suite's other worker (it took over 10 s there once).
READ_TIMEOUT_S = 30.0
CONNECTION_WINDOW = 2**30  # granted at once: only the per-stream windows limit the server


def h2_client(server: RunningServer, certificate: Certificate, **kwargs: Any) -> httpx.AsyncClient:
    """httpx over TLS that speaks HTTP/2 (ALPN h2) to ``server``."""
    return httpx.AsyncClient(base_url=server.base_url, http2=True, trust_env=False,
                             verify=certificate.client_context(("h2", "http/1.1")),
                             timeout=SETTLE_TIMEOUT_S, **kwargs)


# -- a raw HTTP/2 client ---------------------------------------------------------------


@dataclass
class H2Stream:
    """One request's stream as the client saw it."""

    stream_id: int
    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    raw: bytearray = field(default_factory=bytearray)
    events: list[ServerSentEvent] = field(default_factory=list)
    parser: SSEParser = field(default_factory=SSEParser)
    ended: bool = False  # END_STREAM came
    reset: int | None = None  # the error code of the server's RST_STREAM
    held: bool = False  # the client withholds this stream's WINDOW_UPDATEs
    unacknowledged: int = 0  # bytes received while held
    arrivals: list[float] = field(default_factory=list)  # trio.current_time() of each token

    @property
    def done(self) -> bool:
        return self.ended or self.reset is not None

    def request_id(self) -> str:
        start = next(e for e in self.events if e.event == "start")
        return str(json.loads(start.data)["id"])

    def tokens(self) -> list[int]:
        return [json.loads(e.data)["id"] for e in self.events if e.event == "token"]


class H2Client:
    """An HTTP/2 connection over TLS (ALPN h2), driven by the test (see the module docstring).

    Reads happen only inside ``read_until``: the test decides when the client reads.
    """

    def __init__(self, stream: trio.SSLStream[trio.SocketStream], host: str) -> None:
        self.stream = stream
        self.host = host
        self.conn = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding=None))
        self.streams: dict[int, H2Stream] = {}
        self.goaway: h2.events.ConnectionTerminated | None = None
        self.eof = False  # the server closed the TCP connection
        self.ping_acks = 0

    @classmethod
    async def connect(
        cls, server: RunningServer | tuple[str, int], certificate: Certificate, *,
        stream_window: int | None = None,
    ) -> H2Client:
        """Connect to ``server`` (or a host and port), check ALPN chose h2, send the
        preface (and ``stream_window`` as the initial window of every stream), and grant
        the connection's window."""
        host, port = server if isinstance(server, tuple) else (server.host, server.port)
        tcp = await trio.open_tcp_stream(host, port)
        tls = trio.SSLStream(tcp, certificate.client_context(), server_hostname="localhost")
        await tls.do_handshake()
        assert tls.selected_alpn_protocol() == "h2"
        client = cls(tls, host)
        client.conn.initiate_connection()
        if stream_window is not None:
            client.conn.update_settings(
                {h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: stream_window})
        client.conn.increment_flow_control_window(CONNECTION_WINDOW)
        await client.flush()
        return client

    async def flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            await self.stream.send_all(data)

    def _headers(self, method: str, path: str, extra: Sequence[tuple[str, str]]) -> list[Any]:
        return [(b":method", method.encode()), (b":scheme", b"https"),
                (b":authority", self.host.encode()), (b":path", path.encode()),
                *((k.encode(), v.encode()) for k, v in extra)]

    def start_post(self, path: str, body: dict[str, Any], *, reset: bool = False) -> H2Stream:
        """Queue a POST with a JSON body (and, with ``reset``, its RST_STREAM) without
        sending: ``flush`` sends everything queued in one write."""
        payload = json.dumps(body).encode()
        stream_id = self.conn.get_next_available_stream_id()
        headers = [("content-type", "application/json"), ("content-length", str(len(payload)))]
        self.conn.send_headers(stream_id, self._headers("POST", path, headers))
        self.conn.send_data(stream_id, payload, end_stream=True)
        if reset:
            self.conn.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)
        self.streams[stream_id] = stream = H2Stream(stream_id)
        return stream

    async def post(self, path: str, body: dict[str, Any]) -> H2Stream:
        stream = self.start_post(path, body)
        await self.flush()
        return stream

    async def get(self, path: str, headers: Sequence[tuple[str, str]] = ()) -> H2Stream:
        stream_id = self.conn.get_next_available_stream_id()
        self.conn.send_headers(stream_id, self._headers("GET", path, headers), end_stream=True)
        self.streams[stream_id] = stream = H2Stream(stream_id)
        await self.flush()
        return stream

    async def reset(self, stream: H2Stream) -> None:
        """RST_STREAM (CANCEL): the client gives this stream up."""
        self.conn.reset_stream(stream.stream_id, h2.errors.ErrorCodes.CANCEL)
        await self.flush()

    async def overflow_window(self, stream: H2Stream) -> None:
        """A WINDOW_UPDATE of 2^31-1 on ``stream``: the window the server sends in
        overflows, and the server resets the stream itself (MadeYouReset, CVE-2025-8671).
        Raw: h2 refuses to send it."""
        await self.flush()
        frame = WindowUpdateFrame(stream.stream_id, window_increment=2**31 - 1)
        await self.stream.send_all(frame.serialize())

    async def release(self, stream: H2Stream) -> None:
        """Acknowledge what a held stream received, and stop holding it."""
        stream.held = False
        if stream.unacknowledged:
            self.conn.acknowledge_received_data(stream.unacknowledged, stream.stream_id)
            stream.unacknowledged = 0
        await self.flush()

    async def read_until(self, condition: Callable[[], bool]) -> None:
        """Read and handle frames until ``condition()`` holds; fail if the server closed
        the connection first."""
        with trio.fail_after(READ_TIMEOUT_S):
            while not condition():
                assert not self.eof, "the server closed the connection"
                await self.read_once()

    async def read_once(self) -> None:
        data = await self.stream.receive_some(65536)
        if not data:
            self.eof = True
            return
        for event in self.conn.receive_data(data):
            self._handle(event)
        await self.flush()

    async def read_to_eof(self) -> None:
        with trio.fail_after(READ_TIMEOUT_S):
            while not self.eof:
                try:
                    await self.read_once()
                except (trio.BrokenResourceError, h2.exceptions.ProtocolError):
                    self.eof = True

    def _handle(self, event: h2.events.Event) -> None:
        if isinstance(event, h2.events.ConnectionTerminated):
            self.goaway = event
            return
        if isinstance(event, h2.events.PingAckReceived):
            self.ping_acks += 1
            return
        stream = self.streams.get(getattr(event, "stream_id", 0) or 0)
        if stream is None:
            return
        if isinstance(event, h2.events.ResponseReceived):
            headers = {bytes(k).decode(): bytes(v).decode() for k, v in event.headers}
            stream.status = int(headers.pop(":status"))
            stream.headers = headers
        elif isinstance(event, h2.events.DataReceived):
            stream.raw += event.data
            new = stream.parser.feed(bytes(event.data))
            now = trio.current_time()
            stream.arrivals += [now for e in new if e.event == "token"]
            stream.events += new
            if stream.held:
                stream.unacknowledged += event.flow_controlled_length
            else:
                self.conn.acknowledge_received_data(event.flow_controlled_length,
                                                    stream.stream_id)
        elif isinstance(event, h2.events.StreamEnded):
            stream.ended = True
            stream.events += stream.parser.close()
        elif isinstance(event, h2.events.StreamReset):
            stream.reset = event.error_code

    async def close_clean(self) -> None:
        """FIN: shut down the TCP connection for writing (no TLS close_notify, no GOAWAY),
        then close."""
        sock = self.stream.transport_stream.socket
        sock.shutdown(socket.SHUT_WR)
        with trio.move_on_after(READ_TIMEOUT_S):
            while await self.stream.transport_stream.receive_some(65536):
                pass
        sock.close()

    def close_abort(self) -> None:
        """RST: linger on with a zero timeout makes close() reset the connection."""
        sock = self.stream.transport_stream.socket
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()


def token_ids(events: list[ServerSentEvent]) -> list[int]:
    return [json.loads(e.data)["id"] for e in events if e.event == "token"]
