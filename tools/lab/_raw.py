"""A raw-socket HTTP/1.1 client for the experiments that choose how a client reads and leaves.

``python -m tools.lab`` skips this module (its name starts with ``_``); the slowclient,
disconnect, leak and buffers experiments share it. It is the tools' own copy of what
``tests/http_clients.RawClient`` does (tools never import tests), plus timing.

``RawStream`` sends one request over a Trio socket (h11 does the framing), then reads
as its caller says: as fast as it can, one chunk at a time with pauses, until a number
of tokens, or not at all. It leaves as its caller says: ``close_fin()`` (shutdown for
writing, which sends a FIN at once, then read to the server's EOF) or ``close_rst()``
(``SO_LINGER`` (on, 0): the kernel resets the connection). The time of leaving is taken
just before the FIN or RST goes out, on both clocks: ``time.perf_counter()`` for
durations, ``time.time()`` to compare with the server's ``finished_at`` (same machine,
same wall clock).

Every stream event of ``/v1/stream`` is recorded: the start event's request id, each
token's arrival (the time of the ``recv`` that completed it), and the terminal event.
"""

from __future__ import annotations

import json
import socket
import struct
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import h11
import trio

from streams import SSEParser

RECV_BYTES = 65536  # one read: what httpx reads at a time, too
READ_TIMEOUT_S = 300.0  # a safety net: under a burst of prefills on a CPU a token can take s


class RawStreamError(RuntimeError):
    """The stream did not do what the experiment needed (the message says what it did)."""


def host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if parts.hostname is None or parts.port is None:
        raise ValueError(f"expected http://HOST:PORT, not {url!r}")
    return parts.hostname, parts.port


class RawStream:
    """One request over a raw socket; see the module docstring."""

    def __init__(self, url: str) -> None:
        self.host, self.port = host_port(url)
        self.sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_STREAM)
        self.conn = h11.Connection(h11.CLIENT)
        self.parser = SSEParser()
        self.status: int | None = None
        self.request_id: str | None = None
        self.prompt_tokens: int | None = None
        self.token_times: list[float] = []
        self.finish_reason: str | None = None  # from done
        self.error_type: str | None = None  # from an error event, or a broken connection
        self.ended = False  # the body ended (or the connection did)
        self.body_bytes = 0
        self.sent_at: float | None = None  # perf_counter
        self.sent_wall: float | None = None  # time.time()
        self.finished_at: float | None = None  # the terminal event or the end arrived
        self.closed_at: float | None = None  # perf_counter, as the FIN or RST went out
        self.closed_wall: float | None = None
        self._connected = False

    @property
    def tokens(self) -> int:
        return len(self.token_times)

    @property
    def terminal(self) -> str | None:
        """"done", "error:TYPE", or None while the stream runs."""
        if self.finish_reason is not None:
            return "done"
        return None if self.error_type is None else f"error:{self.error_type}"

    async def connect(self) -> None:
        """Open the TCP connection (so that a later ``post`` holds no handshake)."""
        await self.sock.connect((self.host, self.port))
        self._connected = True

    async def post(self, path: str, body: dict[str, Any]) -> None:
        """Send the request (connecting first if needed). Cancellation: closed by its
        owner: the socket is the caller's, and stays open, the request perhaps half
        sent; the caller resets it on its way out (``close_rst``: synchronous, so it
        runs in a cancelled scope), which the server reads as a client gone."""
        if not self._connected:
            await self.connect()
        payload = json.dumps(body).encode()
        headers = [("Host", f"{self.host}:{self.port}"), ("Content-Type", "application/json"),
                   ("Content-Length", str(len(payload)))]
        data = self.conn.send(h11.Request(method="POST", target=path, headers=headers))
        data += self.conn.send(h11.Data(data=payload)) + self.conn.send(h11.EndOfMessage())
        self.sent_at, self.sent_wall = time.perf_counter(), time.time()
        while data:
            data = data[await self.sock.send(data):]

    async def read_chunk(self, size: int = RECV_BYTES) -> bool:
        """One ``recv`` of at most ``size`` bytes, parsed; False once the body ended.

        Raises:
            trio.TooSlowError: nothing arrived in READ_TIMEOUT_S.
        """
        if self.ended:
            return False
        with trio.fail_after(READ_TIMEOUT_S):
            try:
                data = await self.sock.recv(size)
            except OSError:
                data = b""
        now = time.perf_counter()
        self.conn.receive_data(data)
        while True:
            try:
                event = self.conn.next_event()
            except h11.RemoteProtocolError:
                event = h11.ConnectionClosed()
            if event is h11.NEED_DATA:
                break
            if isinstance(event, h11.Response):
                self.status = event.status_code
                if self.status != 200:  # a refusal: its body is the JSON envelope
                    self.error_type = f"http_{self.status}"
            elif isinstance(event, h11.Data) and self.status != 200:
                self.body_bytes += len(event.data)
            elif isinstance(event, h11.Data):
                self.body_bytes += len(event.data)
                for sse in self.parser.feed(bytes(event.data)):
                    self._on_event(sse.event, sse.data, now)
            elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                self._end(now, self.error_type or (None if self.terminal else "connection_closed"))
                break
        return not self.ended

    async def read_until(self, condition: Callable[[RawStream], bool]) -> None:
        """Read until ``condition(self)`` or the end of the body.

        Raises:
            RawStreamError: the body ended and ``condition`` never held.
        """
        while not condition(self):
            if not await self.read_chunk():
                if not condition(self):
                    raise RawStreamError(f"the stream ended ({self.terminal}) first")
                return

    async def read_to_end(self) -> None:
        """Read to the end of the body, whatever it holds."""
        while await self.read_chunk():
            pass

    async def read_slowly(self, pause_s: float, size: int = RECV_BYTES) -> None:
        """Read a chunk, sleep ``pause_s``, repeat, to the end of the body."""
        # The sleep is the point: this reader is slow on purpose, with nothing to wait for.
        while await self.read_chunk(size):  # noqa: ASYNC110
            await trio.sleep(pause_s)

    def _mark_closed(self) -> None:
        self.closed_at, self.closed_wall = time.perf_counter(), time.time()

    async def close_fin(self, drain_timeout_s: float = 30.0) -> None:
        """FIN: shut down our sending side now, read to the server's EOF (at most
        ``drain_timeout_s``), then close. Reading on keeps unread data from turning the
        final close into an RST before the server has seen the FIN."""
        self._mark_closed()
        try:
            self.sock.shutdown(socket.SHUT_WR)
            with trio.move_on_after(drain_timeout_s):
                while await self.sock.recv(RECV_BYTES):
                    pass
        except OSError:
            pass
        self.sock.close()

    def close_rst(self) -> None:
        """RST: linger on with a zero timeout makes close() reset the connection."""
        self._mark_closed()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.sock.close()

    async def close(self, how: str) -> None:
        """``close_fin()`` for "fin", ``close_rst()`` for "rst"."""
        if how == "fin":
            await self.close_fin()
        elif how == "rst":
            self.close_rst()
        else:
            raise ValueError(f"close by fin or rst, not {how!r}")

    def _on_event(self, name: str, data: str, now: float) -> None:
        if name == "token":
            self.token_times.append(now)
        elif name == "start":
            start = json.loads(data)
            self.request_id, self.prompt_tokens = start["id"], start["prompt_tokens"]
        elif name == "done":
            self.finish_reason = json.loads(data)["finish_reason"]
            self._end(now, None)
        elif name == "error":
            self._end(now, json.loads(data)["error"]["type"])

    def _end(self, now: float, error_type: str | None) -> None:
        if error_type is not None and self.error_type is None:
            self.error_type = error_type
        if self.finished_at is None:
            self.finished_at = now
        if error_type is not None or self.finish_reason is not None:
            self.ended = True

    def gaps_s(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]

    def to_json(self, origin: float) -> dict[str, Any]:
        """Plain data; times in ms from ``origin`` (a perf_counter time)."""

        def ms(t: float | None) -> float | None:
            return None if t is None else round((t - origin) * 1000, 2)

        return {
            "request_id": self.request_id,
            "status": self.status,
            "tokens": self.tokens,
            "terminal": self.terminal,
            "finish_reason": self.finish_reason,
            "body_bytes": self.body_bytes,
            "sent_ms": ms(self.sent_at),
            "finished_ms": ms(self.finished_at),
            "closed_ms": ms(self.closed_at),
            "token_ms": [ms(t) for t in self.token_times],
        }


async def finish_record(client: Any, request_id: str, timeout_s: float = 60.0) -> dict[str, Any]:
    """``GET /v1/lab/requests/<id>`` (the lab's server: the finish record with its wall-clock
    ``finished_at``) with the httpx ``client``, waiting (polling) until the engine has let
    the request go.

    Raises:
        trio.TooSlowError: not finished after ``timeout_s``.
    """
    with trio.fail_after(timeout_s):
        while True:
            response = await client.get(f"/v1/lab/requests/{request_id}")
            if response.status_code == 200:
                record: dict[str, Any] = response.json()
                return record
            if response.status_code != 404:
                response.raise_for_status()
            await trio.sleep(0.02)
