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

Protocols: ours and the OpenAI-compatible streaming completions (``tools/wire.py``).

Nothing here is sent anywhere but the URL given; every client has ``trust_env=False``.
"""

from __future__ import annotations

import argparse
import json
import ssl
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import trio
from tqdm import tqdm

from streams import SSEParser
from tools.prompts import PROMPTS_FILE
from tools.wire import PROTOCOLS, WireProtocol

STOPPED = "stopped by the caller"
# Generous: under a burst of prefills on a CPU a first token can take seconds.
READ_TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class StreamRequest:
    """One stream to open. ``at_s``: send it this long after the start, not at once."""

    prompt: str
    max_new_tokens: int
    ignore_eos: bool = False
    at_s: float | None = None
    tag: str = ""  # a label for the experiment's own use ("long", "joiner", ...)


@dataclass(slots=True)
class StreamRecord:
    """What one stream did. Times are ``time.perf_counter()`` seconds."""

    index: int
    client: int
    request: StreamRequest
    sent_at: float | None = None
    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    request_id: str | None = None  # from the start event (streamscope)
    prompt_tokens: int | None = None
    token_ids: list[int] = field(default_factory=list)  # streamscope only
    texts: list[str] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    finished_at: float | None = None  # the terminal event arrived (or the body ended)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    bytes: int = 0
    error: str | None = None
    raw: bytearray | None = None  # the body as received, when asked for

    @property
    def tokens(self) -> int:
        return len(self.token_times)

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish_reason is not None

    @property
    def ttft_s(self) -> float | None:
        if self.sent_at is None or not self.token_times:
            return None
        return self.token_times[0] - self.sent_at

    @property
    def duration_s(self) -> float | None:
        if self.sent_at is None or self.finished_at is None:
            return None
        return self.finished_at - self.sent_at

    def gaps_s(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]

    def add_token(self, token_id: int | None, text: str, now: float) -> None:
        if token_id is not None:
            self.token_ids.append(token_id)
        self.texts.append(text)
        self.token_times.append(now)

    def to_json(self, origin: float) -> dict[str, Any]:
        """Plain data; times in ms from ``origin`` (the run's start)."""

        def ms(t: float | None) -> float | None:
            return None if t is None else round((t - origin) * 1000, 2)

        ttft = self.ttft_s
        return {
            "index": self.index,
            "client": self.client,
            "tag": self.request.tag,
            "prompt": self.request.prompt[:40],
            "status": self.status,
            "request_id": self.request_id,
            "prompt_tokens": self.prompt_tokens,
            "tokens": self.tokens,
            "finish_reason": self.finish_reason,
            "error": self.error,
            "usage": self.usage,
            "bytes": self.bytes,
            "sent_ms": ms(self.sent_at),
            "ttft_ms": None if ttft is None else round(ttft * 1000, 2),
            "finished_ms": ms(self.finished_at),
            "token_ids": self.token_ids,
            "token_ms": [ms(t) for t in self.token_times],
        }


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
) -> LoadResult:
    """Open every stream in ``requests`` from ``clients`` connections (default: one each).

    Args:
        url: the server's base URL.
        ready: awaited after every client has connected and before the start; the
            ``at_s`` of each request counts from when it returns.
        on_first_token: called (synchronously) when a stream's first token arrives.
        stop: once set, every stream still open is closed (the server sees its client
            go) and the run returns; those streams have the error ``STOPPED``.
        keep_raw: keep each body's bytes in ``record.raw``.

    A stream that fails (a status other than 200, an error event, a broken connection)
    is recorded with its ``error``; the run goes on.

    Cancellation: every client closes its connection (the server sees a disconnect) and
    Cancelled propagates; the records so far are lost with the call.
    """
    wire = PROTOCOLS[protocol]
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
                    await _one_stream(client, wire, record, model, keep_raw, count)

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
    return LoadResult(protocol, records, gate.started_at)


async def _cancel_when_set(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel(reason="the caller stopped the run")


async def _one_stream(
    client: httpx.AsyncClient,
    wire: WireProtocol,
    record: StreamRecord,
    model: str | None,
    keep_raw: bool,
    count: Callable[[StreamRecord, int], None],
) -> None:
    """Send one request and read its body to the end into ``record``.

    Cancellation: httpx closes the connection; ``record`` keeps what arrived.
    """
    parser = SSEParser()
    record.raw = bytearray() if keep_raw else None
    record.sent_at = time.perf_counter()
    try:
        async with client.stream("POST", wire.path, json=wire.body(record.request, model)) as r:
            record.status, record.headers = r.status_code, dict(r.headers)
            if r.status_code != 200:
                record.error = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
                return
            async for chunk in r.aiter_raw():
                now = time.perf_counter()
                record.bytes += len(chunk)
                if record.raw is not None:
                    record.raw += chunk
                for event in parser.feed(chunk):
                    count(record, wire.on_event(record, event, now))
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        record.error = record.error or f"{type(exc).__name__}: {exc}"
    finally:
        if record.finished_at is None:
            record.finished_at = time.perf_counter()
    if record.error is None and record.finish_reason is None:
        record.error = "the body ended without a terminal event"


async def run_load(
    url: str,
    prompts: Sequence[str],
    *,
    clients: int,
    max_new_tokens: int = 64,
    ignore_eos: bool = False,
    requests: int | None = None,
    **options: Any,
) -> LoadResult:
    """``requests`` streams (default ``clients``) over prompts in turn, from ``clients``
    connections; ``options`` go to ``run_streams``."""
    count = requests or clients
    specs = [
        StreamRequest(prompts[i % len(prompts)], max_new_tokens, ignore_eos) for i in range(count)
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
