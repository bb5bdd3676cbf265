"""Load generator: N concurrent streaming clients against a server over HTTP, on Trio.

::

    python -m tools.load --url http://127.0.0.1:8000 --clients 32 --ignore-eos
    STREAMSCOPE_MODEL=tiny-gpt2 python -m tools.load --start-server --clients 4
    python -m tools.load --url http://127.0.0.1:8080 --protocol openai --model smollm2 \\
        --clients 32 --ignore-eos --json results/llamacpp-32.json

What it measures, per stream and over all streams:

* TTFT: from the request handed to httpx to the arrival of the chunk that held the first
  token. Events parsed from one chunk share that chunk's arrival time.
* gaps: between consecutive tokens of one stream; p50 and p99 over every gap of every
  stream. A gap of 0 means two tokens arrived in one chunk.
* makespan: the first request sent to the last stream's terminal event.
* tokens/s: every token received, over the makespan.
* bytes per token: response body bytes (the SSE text after HTTP/1.1 chunked framing is
  removed; headers not counted; ``start`` and ``done`` events counted, as the chapter
  did) over tokens.

Clients. Each client is its own ``httpx.AsyncClient`` limited to one connection, so no
two streams share a connection. Each opens its connection (a GET of a cheap path) before
the start barrier, so TTFT holds no TCP handshake, and all are released at once. With
fewer clients than requests, client ``k`` sends requests ``k, k + clients, ...`` one
after another, so ``--clients 1`` is the back-to-back baseline.

Parsing. Bodies go through our ``streams.SSEParser``, fed the raw bytes as they arrive:
that counts bytes exactly and stamps each event with its chunk's arrival. httpx-sse reads
through httpx's text line decoder, which also splits lines at U+2028 and the other
separators of ``str.splitlines()``, so it would misread a peer that sends those
unescaped. (``python -m tools.lab sse`` checks that both parsers agree on our server.)

Protocols: ours and the OpenAI-compatible streaming completions (``tools/wire.py``). The
request and record types are in ``tools/records.py``.

Retries (off by default; ``Retries``, ``--retries``, ``--resumable``). A request refused
before its first byte in a way that says "try again" is sent again, up to
``--retries`` times: 503 or 429 with ``Retry-After`` (a draining replica, an admission
limit; the wait is that header, capped by ``--retry-wait-cap``), or a connection refused
(nothing was sent). Anything else is an error: a 503 without ``Retry-After``, a reset
after the request went out (the server may have started on it). With ``--resumable``
every stream asks for ``"resumable": true``, and one whose body ends, or whose
connection breaks, before its terminal event is resumed up to ``--resumes`` times: ``GET``
its ``X-Resume-URL`` with ``Last-Event-ID`` (the last event id received), read on into
the same record (its tokens, times and bytes go on). A resume refused with 503/429 and
``Retry-After``, or 409 ``stream_busy``, counts as a refusal and is retried the same way.
The record says how many of each it took (``retries``, ``resumes``) and what they were
(``retried``); the summary counts the streams that needed them.

Nothing here is sent anywhere but the URL given; every client has ``trust_env=False``.
"""

from __future__ import annotations

import argparse
import enum
import json
import ssl
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import trio
from tqdm import tqdm

from streams import SSEParser
from tools.prompts import PROMPTS_FILE
from tools.records import StreamRecord, StreamRequest
from tools.wire import PROTOCOLS, WireProtocol

STOPPED = "stopped by the caller"
# Statuses that refuse a request before its first byte and may say when to try again
# (with Retry-After): a draining or overloaded server. 409 only for a resume (the
# stream's previous reader had not let go yet: "try again").
RETRYABLE_STATUSES = frozenset({429, 503})
RESUME_BUSY = 409
# A refusal's wait when it names none (a connection refused): a replica that is going
# away is out of its balancer's pool within a health check or two.
RETRY_WAIT_S = 0.1
# The longest Retry-After a client waits by default (a server asking for minutes is
# better reported than waited for in a load test).
RETRY_WAIT_CAP_S = 5.0
# Generous: under a burst of prefills on a CPU a first token can take seconds.
READ_TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class Retries:
    """What a client tries again (see the module docstring); the default: nothing."""

    refusals: int = 0  # sends again of a request refused before its first byte, per stream
    resumes: int = 0  # resumes of a resumable stream cut before its terminal event
    max_wait_s: float = RETRY_WAIT_CAP_S  # the cap on a Retry-After wait


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (linear interpolation), or None for no values."""
    return float(np.percentile(values, q)) if len(values) else None


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


@dataclass(slots=True)
class LoadResult:
    """Every stream of one run; ``summary()`` gives the aggregate figures."""

    protocol: str
    records: list[StreamRecord]
    started_at: float  # the barrier opened

    def summary(self) -> dict[str, Any]:
        sent = [r.sent_at for r in self.records if r.sent_at is not None]
        ends = [r.finished_at for r in self.records if r.finished_at is not None]
        makespan = max(ends) - min(sent) if sent and ends else None
        tokens = sum(r.tokens for r in self.records)
        ttfts = [t for r in self.records if (t := r.ttft_s) is not None]
        gaps = [g for r in self.records for g in r.gaps_s()]
        body_bytes = sum(r.bytes for r in self.records)
        return {
            "streams": len(self.records),
            "streams_ok": sum(r.ok for r in self.records),
            "errors": sum(r.error is not None for r in self.records),
            # ok in the end, after a refusal sent again / after a cut resumed
            "retried_ok": sum(r.ok and r.retries > 0 for r in self.records),
            "resumed_ok": sum(r.ok and r.resumes > 0 for r in self.records),
            "tokens": tokens,
            "makespan_s": None if makespan is None else round(makespan, 4),
            "tokens_per_s": round(tokens / makespan, 2) if makespan else None,
            "ttft_p50_ms": _ms(percentile(ttfts, 50)),
            "ttft_p99_ms": _ms(percentile(ttfts, 99)),
            "gap_p50_ms": _ms(percentile(gaps, 50)),
            "gap_p99_ms": _ms(percentile(gaps, 99)),
            "bytes_per_token": round(body_bytes / tokens, 2) if tokens else None,
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "summary": self.summary(),
            "protocol": self.protocol,
            "streams": [r.to_json(self.started_at) for r in self.records],
        }


# -- running streams ---------------------------------------------------------------------------


class _StartGate:
    """A barrier: every client arrives, then (optionally) ``ready()``, then all go."""

    def __init__(self, parties: int, ready: Callable[[], Awaitable[object]] | None) -> None:
        self.parties, self.arrived, self.ready = parties, 0, ready
        self.all_arrived, self.go = trio.Event(), trio.Event()
        self.started_at = 0.0

    async def wait(self) -> None:
        self.arrived += 1
        if self.arrived == self.parties:
            self.all_arrived.set()
        await self.go.wait()

    async def open_when_ready(self) -> None:
        """Cancellation: the clients never start."""
        await self.all_arrived.wait()
        if self.ready is not None:
            await self.ready()
        self.started_at = time.perf_counter()
        self.go.set()


async def run_streams(
    url: str,
    requests: Sequence[StreamRequest],
    *,
    protocol: str = "streamscope",
    clients: int | None = None,
    model: str | None = None,
    keep_raw: bool = False,
    progress: bool = True,
    ready: Callable[[], Awaitable[object]] | None = None,
    on_first_token: Callable[[StreamRecord], None] | None = None,
    stop: trio.Event | None = None,
    stop_sending: trio.Event | None = None,
    retries: Retries | None = None,
) -> LoadResult:
    """Open every stream in ``requests`` from ``clients`` connections (default: one each).

    Args:
        url: the server's base URL.
        ready: awaited after every client has connected and before the start; the
            ``at_s`` of each request counts from when it returns.
        on_first_token: called (synchronously) when a stream's first token arrives.
        stop: once set, every stream still open is closed (the server sees its client
            go) and the run returns; those streams have the error ``STOPPED``.
        stop_sending: once set, no client sends another request; the open streams
            finish, and the requests never sent are left out of the result.
        retries: what to try again (see the module docstring); default: nothing.
        keep_raw: keep each body's bytes in ``record.raw``.

    A stream that fails (a status other than 200, an error event, a broken connection)
    is recorded with its ``error``; the run goes on.

    Cancellation: every client closes its connection (the server sees a disconnect) and
    Cancelled propagates; the records so far are lost with the call.
    """
    wire = PROTOCOLS[protocol]
    policy = retries or Retries()
    clients = max(1, min(clients or len(requests), len(requests)))
    records = [StreamRecord(i, i % clients, r) for i, r in enumerate(requests)]
    gate = _StartGate(clients, ready)
    # One TLS context for all clients: httpx builds one per client otherwise, slowly,
    # though every URL here is plain http.
    tls = ssl.create_default_context()
    total = sum(r.max_new_tokens for r in requests)
    with tqdm(
        total=total,
        unit="tok",
        desc=f"{len(requests)} streams",
        disable=not progress,
        leave=False,
        mininterval=0.5,
        file=sys.stderr,
    ) as bar:

        def count(record: StreamRecord, added: int) -> None:
            if added and record.tokens == added and on_first_token is not None:
                on_first_token(record)
            bar.update(added)

        async def client_task(k: int) -> None:
            limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
            timeout = httpx.Timeout(READ_TIMEOUT_S, connect=10.0)
            async with httpx.AsyncClient(
                base_url=url, limits=limits, timeout=timeout, trust_env=False, verify=tls
            ) as client:
                with suppress(httpx.HTTPError):  # the stream's request will say what is wrong
                    await client.get(wire.warm_path)
                await gate.wait()
                for record in records[k::clients]:
                    if record.request.at_s is not None:
                        due = gate.started_at + record.request.at_s
                        await trio.sleep(max(0.0, due - time.perf_counter()))
                    if stop_sending is not None and stop_sending.is_set():
                        return
                    await _one_stream(client, wire, record, model, keep_raw, count, policy)

        with trio.CancelScope() as run_scope:
            async with trio.open_nursery() as watcher:
                if stop is not None:
                    watcher.start_soon(_cancel_when_set, stop, run_scope)
                async with trio.open_nursery() as nursery:
                    for k in range(clients):
                        nursery.start_soon(client_task, k)
                    nursery.start_soon(gate.open_when_ready)
                watcher.cancel_scope.cancel(reason="every stream ended")
    if run_scope.cancelled_caught:
        for record in records:
            if record.error is None and record.finish_reason is None:
                record.error = STOPPED
    if stop_sending is not None:
        records = [r for r in records if r.sent_at is not None]
    return LoadResult(protocol, records, gate.started_at)


async def _cancel_when_set(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel(reason="the caller stopped the run")


class _Outcome(enum.Enum):
    """How one HTTP exchange of a stream ended."""

    OVER = "over"  # the terminal event came, or an error that is not tried again
    REFUSED = "refused"  # refused before its first byte, retryable (``wait`` says when)
    CUT = "cut"  # the body ended, or the connection broke, before the terminal event


async def _one_stream(
    client: httpx.AsyncClient,
    wire: WireProtocol,
    record: StreamRecord,
    model: str | None,
    keep_raw: bool,
    count: Callable[[StreamRecord, int], None],
    retries: Retries,
) -> None:
    """Send one request and read its body to the end into ``record``, sending it again
    after a retryable refusal and resuming it after a cut, as ``retries`` allows.

    Cancellation: httpx closes the connection; ``record`` keeps what arrived.
    """
    record.raw = bytearray() if keep_raw else None
    record.sent_at = time.perf_counter()
    body = wire.body(record.request, model)
    try:
        resuming = False
        while True:
            if resuming:
                assert record.resume_url is not None and record.last_event_id is not None
                outcome, wait = await _exchange(
                    client, wire, record, count, "GET", record.resume_url,
                    headers={"Last-Event-ID": record.last_event_id})
            else:
                outcome, wait = await _exchange(client, wire, record, count, "POST",
                                                wire.path, body=body)
            if outcome is _Outcome.OVER:
                break
            if outcome is _Outcome.REFUSED:
                if record.retries >= retries.refusals:
                    break  # record.error says what the last refusal was
                record.retries += 1
                record.retried.append(record.error or "refused")
                record.error = None
                await trio.sleep(min(wait, retries.max_wait_s))
                continue
            # CUT
            if (record.resumes >= retries.resumes or record.resume_url is None
                    or record.last_event_id is None):
                record.error = record.error or "the body ended without a terminal event"
                break
            record.resumes += 1
            record.retried.append(f"cut after {record.last_event_id}: "
                                  f"{record.error or 'the body ended'}")
            record.error = None
            resuming = True
    finally:
        if record.finished_at is None:
            record.finished_at = time.perf_counter()


async def _exchange(
    client: httpx.AsyncClient,
    wire: WireProtocol,
    record: StreamRecord,
    count: Callable[[StreamRecord, int], None],
    method: str,
    path: str,
    *,
    body: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[_Outcome, float]:
    """One request of a stream (its POST, or a resume's GET) and its body, read into
    ``record``; what happened, and for a retryable refusal how long to wait.

    Cancellation: httpx closes the connection; ``record`` keeps what arrived.
    """
    parser = SSEParser()
    answered = False
    try:
        async with client.stream(method, path, json=body, headers=headers) as r:
            answered = True
            record.status, record.headers = r.status_code, dict(r.headers)
            if r.status_code != 200:
                record.error = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
                if r.status_code == 204 and method == "GET":
                    record.error = "resume: 204 (nothing to resume) before a terminal event"
                wait = _retry_after(r)
                if r.status_code in RETRYABLE_STATUSES and wait is not None:
                    return _Outcome.REFUSED, wait
                if r.status_code == RESUME_BUSY and method == "GET":
                    return _Outcome.REFUSED, RETRY_WAIT_S
                return _Outcome.OVER, 0.0
            if method == "POST" and "x-resume-url" in r.headers:
                record.resume_url = r.headers["x-resume-url"]
            async for chunk in r.aiter_raw():
                now = time.perf_counter()
                record.bytes += len(chunk)
                if record.raw is not None:
                    record.raw += chunk
                for event in parser.feed(chunk):
                    added = wire.on_event(record, event, now)
                    if event.id:
                        record.last_event_id = event.id
                    count(record, added)
    except httpx.ConnectError as exc:  # nothing was sent: refused, or no route
        record.error = f"{type(exc).__name__}: {exc}"
        return _Outcome.REFUSED, RETRY_WAIT_S
    except (httpx.TransportError, httpx.DecodingError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
        if answered and record.request.resumable and record.finish_reason is None:
            return _Outcome.CUT, 0.0
        return _Outcome.OVER, 0.0
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        record.error = record.error or f"{type(exc).__name__}: {exc}"
        return _Outcome.OVER, 0.0
    if record.error is None and record.finish_reason is None:
        if record.request.resumable:
            return _Outcome.CUT, 0.0
        record.error = "the body ended without a terminal event"
    return _Outcome.OVER, 0.0


def _retry_after(response: httpx.Response) -> float | None:
    """The seconds of a ``Retry-After: <seconds>`` header, or None (absent, or a date)."""
    value = response.headers.get("retry-after", "")
    try:
        return max(0.0, float(value))
    except ValueError:
        return None


async def run_load(
    url: str,
    prompts: Sequence[str],
    *,
    clients: int,
    max_new_tokens: int = 64,
    ignore_eos: bool = False,
    requests: int | None = None,
    resumable: bool = False,
    **options: Any,
) -> LoadResult:
    """``requests`` streams (default ``clients``) over prompts in turn, from ``clients``
    connections; ``options`` go to ``run_streams``."""
    count = requests or clients
    specs = [
        StreamRequest(prompts[i % len(prompts)], max_new_tokens, ignore_eos,
                      resumable=resumable)
        for i in range(count)
    ]
    return await run_streams(url, specs, clients=clients, **options)


# -- command line ------------------------------------------------------------------------------


def print_report(result: LoadResult, *, max_rows: int = 64) -> None:
    print(
        f"{'#':>3} {'client':>6} {'ttft ms':>9} {'tokens':>6} {'secs':>7} "
        f"{'gap p50':>8} {'bytes':>7} finish"
    )
    for r in result.records[:max_rows]:
        ttft = f"{r.ttft_s * 1000:9.1f}" if r.ttft_s is not None else f"{'-':>9}"
        gap = percentile(r.gaps_s(), 50)
        gap_text = f"{gap * 1000:8.1f}" if gap is not None else f"{'-':>8}"
        print(
            f"{r.index:>3} {r.client:>6} {ttft} {r.tokens:>6} {r.duration_s or 0:7.2f} "
            f"{gap_text} {r.bytes:>7} {r.finish_reason or r.error}"
        )
    if len(result.records) > max_rows:
        print(f"... {len(result.records) - max_rows} more streams")
    for key, value in result.summary().items():
        print(f"{key:>16}  {value}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.load",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--url", help="the server's base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--protocol", choices=sorted(PROTOCOLS), default="streamscope")
    parser.add_argument("--clients", type=int, default=8, help="concurrent connections")
    parser.add_argument(
        "--requests", type=int, default=None, help="streams in all (default: one per client)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument(
        "--prompts",
        type=Path,
        default=PROMPTS_FILE,
        help="one prompt a line (default: tools/prompts.txt)",
    )
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--model", default=None, help="the model name sent (openai)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument(
        "--start-server",
        action="store_true",
        help="without --url: start our server (tools/server.py); it reads "
        "STREAMSCOPE_* from the environment (default model: smollm2)",
    )
    parser.add_argument(
        "--retries", type=int, default=0, metavar="N",
        help="send a request refused before its first byte (429/503 with Retry-After, or "
        "a connection refused) again, up to N times (default 0)")
    parser.add_argument(
        "--retry-wait-cap", type=float, default=RETRY_WAIT_CAP_S, metavar="SECONDS",
        help="wait Retry-After before a retry, at most this long (default %(default)s)")
    parser.add_argument(
        "--resumable", action="store_true",
        help="ask for resumable streams (streamscope); resume one cut before its terminal "
        "event with Last-Event-ID, up to --resumes times")
    parser.add_argument("--resumes", type=int, default=3, metavar="N",
                        help="resumes per stream with --resumable (default %(default)s)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if not args.url and not args.start_server:
        parser.error("give --url or --start-server")
    prompts = [p for p in args.prompts.read_text(encoding="utf-8").splitlines() if p.strip()]

    async def go(url: str) -> LoadResult:
        return await run_load(
            url,
            prompts,
            clients=args.clients,
            requests=args.requests,
            max_new_tokens=args.max_new_tokens,
            ignore_eos=args.ignore_eos,
            protocol=args.protocol,
            model=args.model,
            progress=not args.no_progress,
            resumable=args.resumable,
            retries=Retries(args.retries, args.resumes if args.resumable else 0,
                            args.retry_wait_cap),
        )

    async def with_server() -> LoadResult:
        from tools.server import open_server

        async with open_server() as url:
            return await go(url)

    result = trio.run(go, args.url) if args.url else trio.run(with_server)
    print_report(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result.to_json(), indent=1))
    return 0 if result.summary()["errors"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
