"""The raw-socket client that sends one hostile request and judges what comes back.

Why a module of its own: the cases are data (``tools/hostile_cases.py``); sending one over
a connection of its own, reading the answer with h11 and deciding whether it was a
finding is the other half that ``tests/test_fuzz_http.py`` and ``python -m tools.lab
fuzz`` share.

``send_case`` sends one case and returns an ``Outcome``. The verdict (the properties the
fuzz asserts):

* a whole request (``LENGTH``, ``CHUNKED``, ``CONFLICT``) must be answered: a response
  head and its body to the framed end, within ``timeout_s``;
* an incomplete one (``SHORT``, ``SLOWLORIS``) must be answered or the connection closed
  by the server, within ``timeout_s`` (``silent_timeout_s`` for a slowloris that goes
  silent without a FIN: only the server's own timeout can end it);
* never a 5xx, and never an ``internal_error`` in a 200 stream's body.

A request that carried ``Connection: close`` should see EOF after its response (RFC 9112
section 9.6); hypercorn 0.18's trio worker does not close (pgjones/hypercorn#330), so the
client waits at most ``eof_wait_s`` for it and records ``close_ignored``, a finding, not
a hang. The responses are parsed by h11, told of a dummy request of the same framing (the
real bytes are ours, often not HTTP h11 would send). ``summarize`` counts the findings.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import h11
import trio

from tools.hostile_cases import INCOMPLETE, Framing, HostileCase

RECV_BYTES = 65536
MAX_BODY_KEPT = 2048  # of a response body, for the report


@dataclass
class Outcome:
    """What came back for one case, and the findings in it."""

    status: int | None = None
    answered: bool = False  # a response head and its body to the framed end
    closed: bool = False  # the server closed (EOF or reset)
    close_ignored: bool = False  # Connection: close, answered, and no EOF within eof_wait_s
    hang: bool = False  # see the module docstring
    internal_error: bool = False  # a 200 body carried an internal_error
    protocol_error: str | None = None  # the response was not valid HTTP
    elapsed_s: float = 0.0
    body: bytes = field(default=b"", repr=False)

    @property
    def five_xx(self) -> bool:
        return self.status is not None and self.status >= 500

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["body"] = self.body[:300].decode("utf-8", "replace")
        return data


async def send_case(
    host: str, port: int, case: HostileCase, *, timeout_s: float = 10.0,
    silent_timeout_s: float = 15.0, eof_wait_s: float = 0.0,
) -> Outcome:
    """Send ``case`` on a new connection and judge what comes back (module docstring).

    Cancellation: closed by its owner: the socket is reset on the way out (what the
    server sees is a reset), and the outcome is lost with the call.
    """
    outcome = Outcome()
    sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_STREAM)
    started = time.perf_counter()
    try:
        await sock.connect((host, port))
        reader = _Reader(sock, case, outcome)
        bound = silent_timeout_s if case.framing is Framing.SLOWLORIS and not case.fin \
            else timeout_s
        with trio.move_on_after(bound):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_send, sock, case, f"{host}:{port}")
                await reader.read()
                nursery.cancel_scope.cancel(reason="answered, or the server closed")
        outcome.hang = not (outcome.answered or outcome.closed)
        if outcome.answered and case.connection_close and not outcome.closed and eof_wait_s:
            with trio.move_on_after(eof_wait_s):
                await reader.wait_eof()
            outcome.close_ignored = not outcome.closed
    finally:
        outcome.elapsed_s = round(time.perf_counter() - started, 4)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    return outcome


async def _send(sock: trio.socket.SocketType, case: HostileCase, host: str) -> None:
    """Send the case's bytes (slowly for a slowloris), then FIN for an incomplete one."""
    data = case.wire(host)
    try:
        if case.framing is Framing.SLOWLORIS:
            for i in range(len(data)):
                await sock.send(data[i : i + 1])
                await trio.sleep(case.pace_s)
        else:
            while data:
                data = data[await sock.send(data):]
        if case.framing in INCOMPLETE and case.fin:
            sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass  # the server answered early and closed: the reader sees it


class _Reader:
    """Reads one response with h11, told of a dummy request framed like the case's."""

    def __init__(self, sock: trio.socket.SocketType, case: HostileCase, outcome: Outcome) -> None:
        self.sock, self.case, self.outcome = sock, case, outcome
        self.conn = h11.Connection(h11.CLIENT)
        headers = [("Host", "x"), ("Content-Length", "0")]
        if case.connection_close:
            headers.append(("Connection", "close"))
        self.conn.send(h11.Request(method="POST", target="/", headers=headers))
        self.conn.send(h11.EndOfMessage())

    async def _recv(self) -> bytes:
        try:
            data = await self.sock.recv(RECV_BYTES)
        except OSError:
            data = b""
        if not data:
            self.outcome.closed = True
        return data

    async def read(self) -> None:
        """Until the response's framed end, or the server closes."""
        while True:
            try:
                event = self.conn.next_event()
            except h11.RemoteProtocolError as exc:
                if not (self.outcome.closed and self.outcome.status is None):
                    self.outcome.protocol_error = str(exc)  # not a plain close
                return
            if event is h11.NEED_DATA:
                self.conn.receive_data(await self._recv())
            elif isinstance(event, h11.Response):
                self.outcome.status = event.status_code
            elif isinstance(event, h11.Data):
                if len(self.outcome.body) < MAX_BODY_KEPT:
                    self.outcome.body += bytes(event.data)
                if self.outcome.status == 200 and b'"internal_error"' in bytes(event.data):
                    self.outcome.internal_error = True
            elif isinstance(event, h11.EndOfMessage):
                self.outcome.answered = True
                return
            elif isinstance(event, h11.ConnectionClosed):
                return

    async def wait_eof(self) -> None:
        while not self.outcome.closed:
            await self._recv()


def summarize(outcomes: list[Outcome]) -> dict[str, Any]:
    """Counts over outcomes: statuses, and each finding."""
    status_counts: dict[str, int] = {}
    for o in outcomes:
        key = str(o.status) if o.status is not None else ("closed" if o.closed else "none")
        status_counts[key] = status_counts.get(key, 0) + 1

    def count(finding: Callable[[Outcome], bool]) -> int:
        return sum(map(finding, outcomes))

    return {
        "status_counts": dict(sorted(status_counts.items())),
        "five_xx": count(lambda o: o.five_xx),
        "hangs": count(lambda o: o.hang),
        "internal_errors": count(lambda o: o.internal_error),
        "protocol_errors": count(lambda o: o.protocol_error is not None),
        "close_ignored": count(lambda o: o.close_ignored),
    }
