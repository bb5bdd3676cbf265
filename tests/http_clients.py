"""Clients for the app's real-HTTP tests: request bodies, SSE parsing, a raw socket.

``RawClient`` is an HTTP/1.1 client over a raw Trio socket (h11 does the framing), for
tests that must choose how the connection ends: a FIN or an RST.
"""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import Callable
from typing import Any

import h11
import httpx
import httpx_sse
import trio

from streams import ServerSentEvent, SSEParser

# A safety net only: every read waits for a condition; this fires only if it never comes.
# A safety net only (every read waits for a condition), so generous: a 480-token stream
# over TLS takes 3.4 s here alone, and a test must pass on a machine 5x slower, or
# beside the suite's other worker (it took over 10 s there once).
READ_TIMEOUT_S = 30.0

LONG_PROMPT = "The capital of France is"  # 8 tokens for the tiny tokenizer
# With ignore_eos: 480 steps, under half a second of decoding on this machine's CPU. Enough
# for a stream to be running still a few steps or polls after a test saw its first tokens
# (the engine runs at most a few steps ahead of the server's event loop, which a reader
# there shares), never enough to outlast a timer: a test that needs a stream running past
# a timer holds or paces the engine's steps (``RecordingEngine.hold``, ``pace``).
LONG_MAX_NEW_TOKENS = 480


def stream_body(prompt: str = LONG_PROMPT, **fields: Any) -> dict[str, Any]:
    return {"prompt": prompt, **fields}


def long_body(**fields: Any) -> dict[str, Any]:
    """A request that decodes for 480 steps unless cancelled."""
    return stream_body(max_new_tokens=LONG_MAX_NEW_TOKENS, ignore_eos=True, **fields)


def parse_sse(raw: bytes) -> list[ServerSentEvent]:
    """All events of a whole body, by our parser."""
    parser = SSEParser()
    return parser.feed(raw) + parser.close()


async def parse_sse_with_httpx_sse(response: httpx.Response) -> list[ServerSentEvent]:
    """All events of a streamed response, by httpx-sse, in our parser's event type."""
    return [
        ServerSentEvent(event=e.event, data=e.data, id=e.id, retry=e.retry)
        async for e in httpx_sse.EventSource(response).aiter_sse()
    ]


class RawClient:
    """One HTTP/1.1 request over a raw Trio socket, h11 doing the framing.

    The test decides how it ends: ``close_clean()`` sends a FIN (shutdown for writing)
    and reads to the server's EOF; ``close_abort()`` sets ``SO_LINGER`` to (on, 0) and
    closes, which makes the kernel send an RST.
    """

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_STREAM)
        self.conn = h11.Connection(h11.CLIENT)
        self.parser = SSEParser()
        self.events: list[ServerSentEvent] = []
        self.response: h11.Response | None = None
        self.raw = b""  # the body as received

    async def post(self, path: str, body: dict[str, Any]) -> None:
        payload = json.dumps(body).encode()
        await self.sock.connect((self.host, self.port))
        headers = [("Host", f"{self.host}:{self.port}"), ("Content-Type", "application/json"),
                   ("Content-Length", str(len(payload)))]
        data = self.conn.send(h11.Request(method="POST", target=path, headers=headers))
        data += self.conn.send(h11.Data(data=payload)) + self.conn.send(h11.EndOfMessage())
        while data:
            sent = await self.sock.send(data)
            data = data[sent:]

    async def read_until(self, condition: Callable[[list[ServerSentEvent]], bool]) -> None:
        """Read until ``condition(events)`` holds; fail at the end of the body."""
        with trio.fail_after(READ_TIMEOUT_S):
            while not condition(self.events):
                event = self.conn.next_event()
                if event is h11.NEED_DATA:
                    self.conn.receive_data(await self.sock.recv(65536))
                elif isinstance(event, h11.Response):
                    self.response = event
                elif isinstance(event, h11.Data):
                    self.raw += event.data
                    self.events += self.parser.feed(bytes(event.data))
                elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                    raise AssertionError(f"the body ended first: {self.events}")

    async def read_to_end(self, timeout_s: float = READ_TIMEOUT_S) -> None:
        """Read the rest of the body; fail unless it ends with its proper terminator
        (``timeout_s``: a net against a hang; a body of many tokens needs more)."""
        with trio.fail_after(timeout_s):
            while True:
                event = self.conn.next_event()
                if event is h11.NEED_DATA:
                    self.conn.receive_data(await self.sock.recv(65536))
                elif isinstance(event, h11.Data):
                    self.raw += event.data
                    self.events += self.parser.feed(bytes(event.data))
                elif isinstance(event, h11.EndOfMessage):
                    return
                else:
                    raise AssertionError(f"unexpected {event!r} before the end of the body")

    async def read_tokens(self, count: int) -> None:
        await self.read_until(lambda events: count_tokens(events) >= count)

    def request_id(self) -> str:
        start = next(e for e in self.events if e.event == "start")
        return str(json.loads(start.data)["id"])

    async def close_clean(self) -> None:
        """FIN: shut down our sending side, read to the server's EOF, then close."""
        self.sock.shutdown(socket.SHUT_WR)
        with trio.fail_after(READ_TIMEOUT_S):
            while await self.sock.recv(65536):
                pass
        self.sock.close()

    def close_abort(self) -> None:
        """RST: linger on with a zero timeout makes close() reset the connection."""
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.sock.close()


def count_tokens(events: list[ServerSentEvent]) -> int:
    return sum(e.event == "token" for e in events)
