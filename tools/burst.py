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
import json
import resource
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
import trio

from tools.burst_clients import burst
from tools.burst_server import (
    SERVER_COMMANDS,
    kernel_counters,
    open_files,
    settle_open_files,
    start_server,
)


def raise_open_files_limit() -> tuple[int, int]:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit; return (soft, hard)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    return soft, hard


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
