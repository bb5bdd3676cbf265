"""A load run: many streams from many HTTP clients, each client on a connection of its
own, all released together.

``run_streams`` is the machinery behind ``python -m tools.load`` and the experiments
that need the same client (``tools/lab``, ``tools/peers``, the benches): it opens the
clients' connections, holds them at one barrier, sends each client's requests in turn
(at their ``at_s`` if given), and stops early when asked. One stream's own exchange, its
retries and resumes, is ``tools/stream_client.py``'s; what is measured and the retry
rules are in ``tools/load.py``'s docstring.
"""

from __future__ import annotations

import ssl
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import suppress
from typing import Any

import httpx
import trio
from tqdm import tqdm

from tools.records import LoadResult, StreamRecord, StreamRequest
from tools.stream_client import Retries, run_one_stream
from tools.wire import PROTOCOLS

STOPPED = "stopped by the caller"
# Generous: under a burst of prefills on a CPU a first token can take seconds.
READ_TIMEOUT_S = 300.0


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
        """Cancellation: nothing to undo: it only waits; the clients never start."""
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
        retries: what to try again (see ``tools/load.py``'s docstring); default: nothing.
        keep_raw: keep each body's bytes in ``record.raw``.

    A stream that fails (a status other than 200, an error event, a broken connection)
    is recorded with its ``error``; the run goes on.

    Cancellation: each client's connection is closed by its owner (the server sees a
    disconnect) and Cancelled propagates; the records so far are lost with the call.
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
                    await run_one_stream(client, wire, record, model, keep_raw, count, policy)

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
