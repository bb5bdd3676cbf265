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
import json
from pathlib import Path

import trio

from tools.load_runner import run_load
from tools.prompts import PROMPTS_FILE
from tools.records import LoadResult, percentile
from tools.stream_client import RETRY_WAIT_CAP_S, Retries
from tools.wire import PROTOCOLS


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
