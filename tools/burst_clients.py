"""The burst itself: raw-socket clients that open a stream at one moment, and what each
answer counts as.

``burst`` is the measurement of ``python -m tools.burst`` and of ``tests/test_serve.py``:
every client makes its socket first and waits on one Event, so all connects start
together, with no pool and no retry to hide a reset. ``judge`` sorts a response read to
EOF by what a client can do with it: a stream to its ``done`` (served), a refusal it can
act on (refused), anything else (other). Why those, and what counts as a connection
error or a hang, is the command's docstring (``tools/burst.py``).
"""

from __future__ import annotations

import errno
import json
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import trio

PROMPT = "The capital of France is"
RECV_BYTES = 65536
SLOW_CONNECT_S = 0.9  # Linux sends a dropped SYN again after 1 s (its initial RTO)


@dataclass(slots=True)
class Answer:
    """What one client got."""

    outcome: str  # served | refused | connection_error | hang | other
    status: int | None = None
    detail: str = ""  # the error's name, the refusal's type, what was wrong
    seconds: float | None = None  # from the release to the end of the answer
    connect_s: float | None = None  # from the release to the connection's establishment


@dataclass(slots=True)
class BurstResult:
    clients: int
    served: int = 0
    refused: int = 0
    connection_errors: int = 0
    hangs: int = 0
    other: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    details: dict[str, int] = field(default_factory=dict)
    last_answer_s: float | None = None
    answer_p50_s: float | None = None
    answer_p99_s: float | None = None
    # Connections established a second or more after the release: the kernel dropped
    # their SYN (the listen backlog was full) and the client sent it again (after 1 s,
    # 3 s, 7 s, 15 s...). A client with a connect timeout shorter than that fails.
    slow_connects: int = 0
    connect_max_s: float | None = None
    examples: list[str] = field(default_factory=list)  # a few "other" answers, for a report

    @classmethod
    def of(cls, answers: list[Answer]) -> BurstResult:
        outcomes = Counter(a.outcome for a in answers)
        times = sorted(a.seconds for a in answers if a.seconds is not None)
        connects = [a.connect_s for a in answers if a.connect_s is not None]
        return cls(
            clients=len(answers),
            served=outcomes["served"],
            refused=outcomes["refused"],
            connection_errors=outcomes["connection_error"],
            hangs=outcomes["hang"],
            other=outcomes["other"],
            statuses={str(k): v for k, v in sorted(
                Counter(a.status for a in answers if a.status is not None).items())},
            details=dict(Counter(f"{a.outcome}: {a.detail}" for a in answers
                                 if a.outcome != "served").most_common()),
            last_answer_s=round(times[-1], 2) if times else None,
            answer_p50_s=round(times[len(times) // 2], 2) if times else None,
            answer_p99_s=round(times[len(times) * 99 // 100], 2) if times else None,
            slow_connects=sum(1 for c in connects if c >= SLOW_CONNECT_S),
            connect_max_s=round(max(connects), 2) if connects else None,
            examples=[a.detail for a in answers if a.outcome == "other"][:5],
        )


def request_bytes(host: str, port: int, max_new_tokens: int) -> bytes:
    body = json.dumps({"prompt": PROMPT, "max_new_tokens": max_new_tokens}).encode()
    head = (f"POST /v1/stream HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n")
    return head.encode() + body


def judge(raw: bytes) -> Answer:
    """Classify a whole response (read to EOF)."""
    head, sep, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    match = re.match(r"HTTP/1\.[01] (\d{3})", lines[0]) if sep else None
    if match is None:
        if not raw:
            return Answer("connection_error", detail="EOF before any answer")
        return Answer("other", detail=f"not an HTTP answer: {raw[:80]!r}")
    status = int(match.group(1))
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = dechunk(body)
    if status == 200:
        if b"event: done" in body:
            return Answer("served", status)
        return Answer("other", status, f"200 without a done event: ...{body[-120:]!r}")
    if status in (429, 503):
        try:
            error_type = json.loads(body)["error"]["type"]
        except (ValueError, KeyError, TypeError):
            return Answer("other", status, f"{status} without the JSON envelope: {body[:120]!r}")
        if "retry-after" not in headers:
            return Answer("other", status, f"{status} {error_type} without Retry-After")
        return Answer("refused", status, f"{status} {error_type}")
    return Answer("other", status, f"status {status}: {body[:120]!r}")


def dechunk(body: bytes) -> bytes:
    """HTTP/1.1 chunked framing removed (as far as it goes: a cut body stays cut)."""
    out = bytearray()
    while body:
        size_line, sep, rest = body.partition(b"\r\n")
        try:
            size = int(size_line.split(b";")[0], 16)
        except ValueError:
            break
        if not sep or size == 0:
            break
        out += rest[:size]
        body = rest[size + 2:]
    return bytes(out)


async def one_client(
    host: str,
    port: int,
    writes: list[bytes],
    start: trio.Event,
    limiter: trio.CapacityLimiter,
    timeout_s: float,
) -> Answer:
    """Connect at ``start``, send ``writes`` (each in one ``send``: they are small), read
    to EOF. Cancellation: closed by its owner: the ``with`` closes the socket (the
    server sees a disconnect); nothing else is held."""
    family = trio.socket.AF_INET6 if ":" in host else trio.socket.AF_INET
    with trio.socket.socket(family, trio.socket.SOCK_STREAM) as sock:
        await start.wait()
        began = time.monotonic()
        chunks: list[bytes] = []
        connect_s = None
        with trio.move_on_after(timeout_s):
            try:
                async with limiter:
                    await sock.connect((host, port))
                connect_s = time.monotonic() - began
                for data in writes:
                    while data:
                        data = data[await sock.send(data):]
                while data := await sock.recv(RECV_BYTES):
                    chunks.append(data)
            except OSError as exc:
                name = errno.errorcode.get(exc.errno or 0, type(exc).__name__)
                answer = judge(b"".join(chunks))
                if answer.status is not None:  # an answer, then the reset
                    return Answer(answer.outcome, answer.status, answer.detail or name,
                                  time.monotonic() - began, connect_s)
                return Answer("connection_error", detail=name, connect_s=connect_s)
            answer = judge(b"".join(chunks))
            answer.seconds = time.monotonic() - began
            answer.connect_s = connect_s
            return answer
        return Answer("hang", detail=f"nothing complete after {timeout_s:g} s "
                      f"({sum(map(len, chunks))} bytes)", connect_s=connect_s)


async def burst(
    url: str,
    clients: int,
    *,
    max_new_tokens: int = 8,
    timeout_s: float = 30.0,
    connect_limit: int | None = None,
    one_write: bool = False,
) -> BurstResult:
    """``clients`` streams opened at the same moment against ``url`` (see
    ``tools/burst.py``'s docstring: the release, the two writes, ``connect_limit``)."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    request = request_bytes(host, port, max_new_tokens)
    head, _, body = request.partition(b"\r\n\r\n")
    writes = [request] if one_write else [head + b"\r\n\r\n", body]
    start = trio.Event()
    limiter = trio.CapacityLimiter(connect_limit or clients)
    answers: list[Answer] = []

    async def run(index: int) -> None:
        answers.append(await one_client(host, port, writes, start, limiter, timeout_s))

    async with trio.open_nursery() as nursery:
        for index in range(clients):
            nursery.start_soon(run, index)
        await trio.sleep(0.2)  # every task has made its socket and waits at the Event
        start.set()
    return BurstResult.of(answers)
