"""A burst: N clients open a stream at the same moment; did each get an HTTP answer?

::

    python -m tools.burst --server serve --clients 1000        # streamscope serve
    python -m tools.burst --server hypercorn --clients 1000    # hypercorn -k trio app:app
    python -m tools.burst --url http://127.0.0.1:8000 --clients 1000 --json out.json

A server whose job is many simultaneous streams must answer every client: a stream
(200, read to its ``done`` event) or a refusal it can act on (429 or 503 with the JSON
error envelope and ``Retry-After``). What it must never do is leave a client with a
connection error (a reset, a refused connect, an end without a status line) or no answer
at all (a hang). This counts each.

Clients: one raw Trio socket each (no pool, no retry: a library that retries would hide
the resets), made before the start; then one Event releases every ``connect`` at once
(``--connect-limit`` bounds how many are in progress together; default: all). Each sends
``POST /v1/stream`` with ``Connection: close`` and reads to EOF, within ``--timeout``
from the release (past it: a hang). The request goes out as two writes, its head and
then its body, as httpx (httpcore over h11) and most HTTP clients send it; that is what
meets the kernel's resets when the listen backlog overflows (on Linux 6.18 with SYN
cookies, a burst of one-write requests waited for retransmits but was never reset).
``--one-write`` sends each request in one write instead, to compare.

Started servers (``--server``, on the tiny GPT-2, CPU, one torch thread, a free port)
are stopped with SIGTERM afterwards; before that the tool reads ``/stats`` (is the cache
whole, is any stream open) and counts the serving process's open files
(``/proc/<pid>/fd``) before the burst and after it, once every client has closed.
Open files: the burst needs two per client (one here, one in the server), so the tool
raises its own soft ``RLIMIT_NOFILE`` to the hard limit, and the server inherits it.

Nothing here is sent anywhere but the server given or started on loopback.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager, suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit

import httpx
import trio

REPO_ROOT = Path(__file__).resolve().parent.parent
SERVER_COMMANDS = {
    # the console script, installed beside this interpreter by `pip install -e .`
    "serve": [str(Path(sys.executable).parent / "streamscope"), "serve", "--bind",
              "127.0.0.1:0"],
    "hypercorn": [sys.executable, "-m", "hypercorn", "-k", "trio", "app:app", "--bind",
                  "127.0.0.1:0"],
}
SERVER_ENV = {
    "STREAMSCOPE_MODEL": "tiny-gpt2",
    "STREAMSCOPE_DEVICE": "cpu",
    "OMP_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
}
# Both commands log hypercorn's line, with the serving process's pid (under the CLI,
# its worker's).
RUNNING_ON = re.compile(r"\[(\d+)\] \[INFO\] Running on http://127\.0\.0\.1:(\d+)")
START_TIMEOUT_S = 120.0  # the tiny model loads in seconds; a safety net
STOP_TIMEOUT_S = 30.0  # the drain's grace (5 s) and a few steps; past this, SIGKILL
SETTLE_TIMEOUT_S = 20.0  # for the server's open files to come back after the burst
POLL_S = 0.05
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


def raise_open_files_limit() -> tuple[int, int]:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit; return (soft, hard)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    return soft, hard


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
    to EOF. Cancellation: the socket is closed."""
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
    """``clients`` streams opened at the same moment against ``url`` (see the docstring)."""
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


# The kernel's own count of what happened at the listen queues (/proc/net/netstat; for
# this network namespace, so other traffic in it counts too): connections that arrived
# at a full accept queue (their SYN or final ACK dropped, to be sent again by the client),
# SYN cookies sent for a full SYN queue, and resets sent.
KERNEL_COUNTERS = ("TcpExt:ListenOverflows", "TcpExt:SyncookiesSent", "Tcp:OutRsts")


def kernel_counters() -> dict[str, int]:
    counters: dict[str, int] = {}
    for path in ("/proc/net/netstat", "/proc/net/snmp"):
        with suppress(OSError), open(path) as file:
            lines = file.read().splitlines()
            for names, values in zip(lines[::2], lines[1::2], strict=False):
                prefix, *keys = names.split()
                for key, value in zip(keys, values.split()[1:], strict=False):
                    counters[prefix + key] = int(value)
    return {name: counters.get(name, 0) for name in KERNEL_COUNTERS}


def open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@dataclass
class StartedServer:
    proc: trio.Process
    pid: int  # the process that serves (under the hypercorn CLI: its worker)
    url: str
    log: IO[bytes]

    def log_text(self) -> str:
        self.log.seek(0)
        return self.log.read().decode("utf-8", "replace")


@asynccontextmanager
async def start_server(
    command: list[str], env: Mapping[str, str] | None = None
) -> AsyncIterator[StartedServer]:
    """``command`` (a server on ``127.0.0.1:0``) ready on the tiny model; stopped at the
    end with SIGTERM, then SIGKILL to its process group after ``STOP_TIMEOUT_S``."""
    log = tempfile.TemporaryFile()  # noqa: SIM115 (closed in the finally below)
    proc = await trio.lowlevel.open_process(
        command, cwd=REPO_ROOT, env={**os.environ, **SERVER_ENV, **(env or {})},
        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = None
    try:
        with trio.fail_after(START_TIMEOUT_S):
            match = None
            while match is None:
                if proc.poll() is not None:
                    log.seek(0)
                    raise RuntimeError(f"the server exited:\n{log.read().decode()[-3000:]}")
                log.seek(0)
                match = RUNNING_ON.search(log.read().decode("utf-8", "replace"))
                await trio.sleep(POLL_S)
            server = StartedServer(proc, int(match.group(1)),
                                   f"http://127.0.0.1:{match.group(2)}", log)
            async with httpx.AsyncClient(base_url=server.url, trust_env=False) as http:
                while (await http.get("/ready")).status_code != 200:  # noqa: ASYNC110
                    await trio.sleep(POLL_S)
        yield server
    finally:
        with trio.CancelScope(shield=True):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                with trio.move_on_after(STOP_TIMEOUT_S):
                    await proc.wait()
            if proc.poll() is None:
                with suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            log.close()


async def settle_open_files(pid: int, baseline: int) -> int:
    """The server's open files, once back at ``baseline`` or after ``SETTLE_TIMEOUT_S``."""
    with trio.move_on_after(SETTLE_TIMEOUT_S):
        while open_files(pid) > baseline:  # noqa: ASYNC110 (no event to wait on)
            await trio.sleep(POLL_S)
    return open_files(pid)


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    limits = raise_open_files_limit()
    report: dict[str, Any] = {"clients": args.clients, "rlimit_nofile": limits,
                              "writes": "one" if args.one_write else "head, then body"}
    if args.url:
        result = await burst(args.url, args.clients, max_new_tokens=args.max_new_tokens,
                             timeout_s=args.timeout, connect_limit=args.connect_limit,
                             one_write=args.one_write)
        report["server"] = args.url
        report["result"] = asdict(result)
        return report
    command = SERVER_COMMANDS[args.server]
    report["server"] = " ".join([Path(command[0]).name, *command[1:]])
    async with start_server(command) as server:
        before = open_files(server.pid)
        counted = kernel_counters()
        result = await burst(server.url, args.clients, max_new_tokens=args.max_new_tokens,
                             timeout_s=args.timeout, connect_limit=args.connect_limit,
                             one_write=args.one_write)
        report["kernel"] = {k: v - counted[k] for k, v in kernel_counters().items()}
        after = await settle_open_files(server.pid, before)
        async with httpx.AsyncClient(base_url=server.url, trust_env=False) as http:
            stats = (await http.get("/stats")).json()
    report["result"] = asdict(result)
    report["server_open_files"] = {"before": before, "after": after}
    report["cache_whole"] = stats["blocks_free"] == stats["blocks_total"]
    report["streams_open_after"] = stats["streams_open"]
    return report


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tools.burst", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--server", choices=sorted(SERVER_COMMANDS), default="serve",
                       help="start this server on the tiny model (default: serve)")
    where.add_argument("--url", help="measure this server instead of starting one")
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=30.0,
                        help="seconds from the release a client waits for its whole answer")
    parser.add_argument("--connect-limit", type=int, default=None,
                        help="connects in progress at once (default: all)")
    parser.add_argument("--one-write", action="store_true",
                        help="send each request in one write, not its head and then its body")
    parser.add_argument("--json", type=Path, help="write the report here too")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = trio.run(measure, args)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
