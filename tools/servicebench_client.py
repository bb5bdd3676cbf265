"""The lean client of ``tools.servicebench``: N streams at once over raw sockets.

::

    python -m tools.servicebench_client --url http://127.0.0.1:PORT --bodies FILE

Why a client of its own: a server's capacity can only be read from a client that costs
less than the server does per token, and an HTTP client library parses every event (and
its JSON) in Python. This one runs in its own process (its CPU is not the server's), uses
only the standard library (``selectors`` over non-blocking sockets: no event-loop
library), opens one connection per stream, all at once, sends each its ``POST
/v1/stream`` (HTTP/1.1, ``Connection: close``, so a stream ends at the server's EOF), and
only counts: a token is an occurrence of ``b"event: token"`` in the bytes received,
counted across ``recv`` boundaries (the last ``len(pattern) - 1`` bytes of a read are
kept and searched again with the next, which cannot count one occurrence twice, as
they are too short to hold one). A token arrives at the time of the read that completed
its pattern; tokens completed by one read share its time (a gap of 0 between them).

Protocol with the parent (so that the parent's measurement window holds the streams
alone, not this process's start): it reads the bodies (a JSON list of request bodies, one
a stream), prints ``ready``, waits for a line on stdin, runs, and prints one JSON line:
the makespan (first connect to last EOF), its own CPU time over the same span
(``time.process_time``), the pooled TTFT (request sent to first token) and gap
percentiles, and each stream's HTTP status, tokens and bytes.
"""

from __future__ import annotations

import argparse
import json
import selectors
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

PATTERN = b"event: token"
RECV_BYTES = 65536
# Give up once no byte has come on any stream for this long: a server whose engine
# failed or hangs would otherwise hold the run forever; a healthy one sends every step.
STALL_S = 30.0


@dataclass(eq=False)
class Stream:
    """One connection's request and what came back."""

    request: bytes
    sent_at: float | None = None
    arrivals: list[float] = field(default_factory=list)
    received: int = 0
    head: bytes = b""  # the first bytes, for the status line
    tail: bytes = b""
    done: bool = False
    error: str | None = None

    def feed(self, data: bytes, now: float) -> None:
        self.received += len(data)
        if len(self.head) < 16:
            self.head += data[:16]
        window = self.tail + data
        found = window.count(PATTERN)
        self.tail = window[-(len(PATTERN) - 1):]
        if found:
            self.arrivals.extend([now] * found)

    def status(self) -> int | None:
        parts = self.head.split(b" ", 2)
        return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None


def request_bytes(host: str, port: int, body: dict[str, Any]) -> bytes:
    payload = json.dumps(body).encode()
    head = (f"POST /v1/stream HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n")
    return head.encode() + payload


def run_streams(host: str, port: int, bodies: list[dict[str, Any]],
                stall_s: float = STALL_S) -> list[Stream]:
    """Open every stream at once and read them all to EOF (or until nothing has come
    for ``stall_s``: the streams still open then end with error ``stalled``)."""
    selector = selectors.DefaultSelector()
    streams = [Stream(request_bytes(host, port, body)) for body in bodies]
    for stream in streams:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.connect_ex((host, port))
        selector.register(sock, selectors.EVENT_WRITE, stream)
    last = time.monotonic()
    while selector.get_map() and time.monotonic() - last < stall_s:
        for key, _ in selector.select(timeout=1.0):
            last = time.monotonic()
            ready, owner = key.fileobj, key.data
            assert isinstance(ready, socket.socket) and isinstance(owner, Stream)
            if owner.sent_at is None:
                _send(selector, ready, owner)
            else:
                _receive(selector, ready, owner)
    for key in list(selector.get_map().values()):
        key.data.error = "stalled"
        _close(selector, key.fileobj)  # type: ignore[arg-type]
    return streams


def _send(selector: selectors.BaseSelector, sock: socket.socket, stream: Stream) -> None:
    error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    if error:
        stream.error = f"connect: errno {error}"
        _close(selector, sock)
        return
    try:
        sent = sock.send(stream.request)
    except BlockingIOError:
        return
    except OSError as exc:
        stream.error = f"send: {exc}"
        _close(selector, sock)
        return
    stream.request = stream.request[sent:]
    if not stream.request:
        stream.sent_at = time.perf_counter()
        selector.modify(sock, selectors.EVENT_READ, stream)


def _receive(selector: selectors.BaseSelector, sock: socket.socket, stream: Stream) -> None:
    try:
        data = sock.recv(RECV_BYTES)
    except OSError as exc:
        stream.error = f"recv: {exc}"
        data = b""
    if data:
        stream.feed(data, time.perf_counter())
    else:
        stream.done = stream.error is None
        _close(selector, sock)


def _close(selector: selectors.BaseSelector, sock: socket.socket) -> None:
    selector.unregister(sock)
    sock.close()


def pct(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) of ``values``, linear between ranks; None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = q * (len(ordered) - 1)
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summary(streams: list[Stream], makespan_s: float, cpu_s: float) -> dict[str, Any]:
    """What the parent reads: see the module docstring (times in ms)."""
    ttfts = [(s.arrivals[0] - s.sent_at) * 1000 for s in streams
             if s.arrivals and s.sent_at is not None]
    gaps = [(b - a) * 1000 for s in streams
            for a, b in zip(s.arrivals, s.arrivals[1:], strict=False)]

    def three(values: list[float]) -> dict[str, float | None]:
        return {"p50": pct(values, 0.5), "p99": pct(values, 0.99),
                "max": max(values) if values else None}

    return {
        "makespan_s": makespan_s, "cpu_s": cpu_s,
        "tokens": sum(len(s.arrivals) for s in streams),
        "bytes": sum(s.received for s in streams),
        "ttft_ms": three(ttfts), "gap_ms": three(gaps), "gaps": len(gaps),
        "streams": [{"status": s.status(), "tokens": len(s.arrivals), "bytes": s.received,
                     "complete": s.done, "error": s.error} for s in streams],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.servicebench_client",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True, help="http://HOST:PORT")
    parser.add_argument("--bodies", required=True, help="a JSON list of request bodies")
    parser.add_argument("--stall-s", type=float, default=STALL_S)
    args = parser.parse_args(argv)
    target = urlsplit(args.url)
    assert target.hostname is not None and target.port is not None, args.url
    with open(args.bodies, encoding="utf-8") as file:
        bodies = json.load(file)
    print("ready", flush=True)
    sys.stdin.readline()
    started, cpu_started = time.perf_counter(), time.process_time()
    streams = run_streams(target.hostname, target.port, bodies, args.stall_s)
    makespan_s = time.perf_counter() - started
    cpu_s = time.process_time() - cpu_started
    print(json.dumps(summary(streams, makespan_s, cpu_s)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
