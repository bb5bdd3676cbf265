"""``fuzz``: thousands of hostile requests to every JSON route; no 5xx, no hang, no leak.

Issue 8, "Hostile traffic". The cases are ``tools/hostile_cases.py``'s, the ones
``tests/test_fuzz_http.py`` sends a few hundred of, drawn here by hypothesis with
``--seed`` (repeatable): bodies of arbitrary bytes and JSON, wrong types, huge numbers,
deep nesting, NUL, invalid UTF-8, over the size limit, or small valid requests (real
streams among the rest); odd content types; chunked bodies; bodies that end early, then
FIN; slowloris heads abandoned with a FIN or in silence (only the server's keep-alive
timeout can end those: they wait in a pool of their own, up to ``SILENT_TIMEOUT_S``).
Each goes on its own connection (``tools/hostile_client.py``), ``--concurrency`` at a
time; a request that carried ``Connection: close`` waits up to ``EOF_WAIT_S`` for the
server's EOF.

The server is the tiny model (``server`` below), started by the experiment itself with
``lab.server()``, so that a crash of it is a finding rather than the end of the run: a
connection refused, then ``/stats`` unanswered, means the server died; the last cases
started before then are kept as reproducers, and a fresh server takes the remaining cases (at
most ``--max-restarts`` times). With ``--url`` there is no restart.

Summary: ``cases`` (sent), ``status_counts`` (by status; ``closed``: closed with no
response, ``none``: neither), ``five_xx``, ``hangs``, ``internal_errors`` (200 streams
that carried one), ``protocol_errors`` (responses that were not valid HTTP),
``close_ignored`` (``Connection: close`` answered without EOF), ``server_deaths``,
``blocks_leaked``, ``double_releases``, ``streams_registered_after``, ``fds_leaked``
(how many more files each server had open after its cases than before, summed), ``by_kind``,
``by_framing`` and ``by_route`` (cases and their findings). Raw: every finding's case as
a reproducer (its exact bytes in base64), and each server's figures.
"""

from __future__ import annotations

import argparse
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import trio

from tools import hostile_cases, hostile_client, server_fds
from tools.hostile_cases import Framing, HostileCase
from tools.hostile_client import Outcome
from tools.lab._raw import host_port
from tools.lab.common import Lab, LabError, Report, experiment

CASE_TIMEOUT_S = 10.0  # an answer takes milliseconds; this long is a hang
SILENT_TIMEOUT_S = 15.0  # hypercorn's keep-alive timeout is 5 s
EOF_WAIT_S = 1.0
SILENT_POOL = 256  # silent slowloris connections held at once
FDS_SETTLE_S = 10.0  # for the server to close what its clients closed
MAX_REPRODUCERS = 50  # per finding
LAST_CASES = 64  # kept at a server's death: more than the cases in flight at once


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cases", type=int, help="default 10000 (quick 150)")
    parser.add_argument("--concurrency", type=int, help="default 16 (quick 8)")
    parser.add_argument("--max-restarts", type=int, default=20,
                        help="fresh servers after a crash (default 20)")


@dataclass
class Epoch:
    """One server's life: the cases it took, and its state afterwards."""

    url: str
    results: list[tuple[HostileCase, Outcome]] = field(default_factory=list)
    died: bool = False
    # The cases started last before the death was seen (the one that killed it has
    # usually finished by then, its connection closed): the reproducers to try first.
    last_cases: list[HostileCase] = field(default_factory=list)
    fds_before: dict[int, int] = field(default_factory=dict)
    fds_after: dict[int, int] = field(default_factory=dict)
    stats_after: dict[str, Any] | None = None


@experiment(
    "fuzz",
    "hostile requests to every JSON route: no 5xx, no hang, the cache whole afterwards",
    server={"model": "tiny-gpt2", "threads": 1, "max_batch": 8, "max_body_bytes": 4096,
            "max_new_tokens_limit": 64},
    arguments=arguments,
    own_servers=True,
)
async def fuzz(lab: Lab) -> Report:
    count = lab.option("cases", 10_000, 150)
    concurrency = lab.option("concurrency", 16, 8)
    max_body = int(str(lab.server_settings.get("max_body_bytes") or 65_536))
    drawn_at = time.perf_counter()
    cases = await trio.to_thread.run_sync(lambda: hostile_cases.sample_cases(
        count, lab.args.seed, max_body_bytes=max_body, silent=True,
        max_pace_s=lab.pick(0.01, 0.002), max_cut=lab.pick(120, 40)))
    draw_s = time.perf_counter() - drawn_at
    pending = list(cases)
    epochs: list[Epoch] = []
    while pending:
        if epochs and (not lab.owns_server or len(epochs) > lab.args.max_restarts):
            break
        async with _server(lab) as url:
            epoch = Epoch(url)
            epochs.append(epoch)
            pending = await _run_epoch(lab, epoch, pending, concurrency)
    results = [r for e in epochs for r in e.results]
    outcomes = [o for _, o in results]
    alive = [e for e in epochs if e.stats_after is not None]
    summary: dict[str, Any] = {
        "cases": len(results),
        **hostile_client.summarize(outcomes),
        "server_deaths": sum(e.died for e in epochs),
        "cases_not_sent": len(pending),
        "blocks_leaked": sum(_leaked(e.stats_after) for e in alive) if alive else None,
        "double_releases": sum(_double(e.stats_after) for e in alive) if alive else None,
        "streams_registered_after": sum(e.stats_after["streams_open"] for e in alive
                                        if e.stats_after) if alive else None,
        "fds_leaked": _fds_leaked(alive),
        "by_kind": _breakdown(results, lambda c: c.kind),
        "by_framing": _breakdown(results, lambda c: c.framing.value),
        "by_route": _breakdown(results, lambda c: c.path),
        "concurrency": concurrency,
        "draw_s": round(draw_s, 2),
    }
    raw = {
        "reproducers": _reproducers(results),
        "last_cases_before_death": [[c.to_json() for c in e.last_cases] for e in epochs
                                    if e.died],
        "servers": [{"url": e.url, "cases": len(e.results), "died": e.died,
                     "fds_before": e.fds_before, "fds_after": e.fds_after,
                     "stats_after": e.stats_after} for e in epochs],
    }
    return Report(summary, raw)


@asynccontextmanager
async def _server(lab: Lab) -> AsyncIterator[str]:
    """A server of the experiment's own (see the module docstring), or ``--url``'s."""
    if not lab.owns_server:
        yield lab.url
        return
    async with lab.server() as url:
        yield url


async def _run_epoch(
    lab: Lab, epoch: Epoch, cases: list[HostileCase], concurrency: int
) -> list[HostileCase]:
    """Send ``cases`` to ``epoch.url`` until done or the server dies; return those unsent.

    Cancellation: closed by its owner: each case in flight is cancelled, and its
    socket's owner, ``hostile_client.send_case``, resets it on the way out; the
    outcomes gathered so far stay in ``epoch.results``. The waits for the server
    (``wait_idle``, ``settled_fds``) leave nothing to undo.
    """
    host, port = host_port(epoch.url)
    await lab.wait_idle(epoch.url)
    pids = server_fds.server_pids(port)
    epoch.fds_before = await server_fds.settled_fds(pids)
    queue = iter(enumerate(cases))
    finished: set[int] = set()
    started: deque[HostileCase] = deque(maxlen=LAST_CASES)
    silent = trio.CapacityLimiter(SILENT_POOL)

    async def one(index: int, case: HostileCase) -> None:
        started.append(case)
        try:
            outcome = await hostile_client.send_case(
                host, port, case, timeout_s=CASE_TIMEOUT_S, silent_timeout_s=SILENT_TIMEOUT_S,
                eof_wait_s=EOF_WAIT_S)
        except OSError:  # refused: is the server still there?
            if not epoch.died and not await _alive(lab, epoch.url):
                epoch.died = True
                epoch.last_cases = list(started)
                nursery.cancel_scope.cancel(reason="the server died")
            return
        epoch.results.append((case, outcome))
        finished.add(index)

    async def worker() -> None:
        for index, case in queue:
            if case.framing is Framing.SLOWLORIS and not case.fin:
                await silent.acquire_on_behalf_of(index)
                nursery.start_soon(_release_after, one, index, case, silent)
            else:
                await one(index, case)

    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(worker)
    if epoch.died:
        return [c for i, c in enumerate(cases) if i not in finished]
    try:
        epoch.stats_after = await lab.wait_idle(epoch.url)
    except LabError:
        epoch.stats_after = await lab.stats(epoch.url)
    epoch.fds_after = await server_fds.settled_fds(pids, epoch.fds_before, FDS_SETTLE_S)
    return []


async def _release_after(
    one: Any, index: int, case: HostileCase, limiter: trio.CapacityLimiter
) -> None:
    try:
        await one(index, case)
    finally:
        limiter.release_on_behalf_of(index)


async def _alive(lab: Lab, url: str) -> bool:
    try:
        await lab.stats(url)
    except httpx.HTTPError:
        return False
    return True


def _leaked(stats: dict[str, Any] | None) -> int:
    return 0 if stats is None else stats["blocks_total"] - stats["blocks_free"]


def _double(stats: dict[str, Any] | None) -> int:
    if stats is None:
        return 0
    admitted, releases = stats.get("admitted") or 0, stats.get("releases") or 0
    return max(0, releases - admitted) + (stats.get("step_errors") or 0)


def _fds_leaked(epochs: list[Epoch]) -> int | None:
    if not epochs or not all(e.fds_before for e in epochs):
        return None
    return sum(max(0, sum(e.fds_after.values()) - sum(e.fds_before.values())) for e in epochs)


def _breakdown(results: list[tuple[HostileCase, Outcome]], key: Any) -> dict[str, Any]:
    groups: dict[str, list[Outcome]] = {}
    for case, outcome in results:
        groups.setdefault(key(case), []).append(outcome)
    return {name: {"cases": len(group),
                   **{k: v for k, v in hostile_client.summarize(group).items()
                      if k != "status_counts" and v}}
            for name, group in sorted(groups.items())}


def _reproducers(results: list[tuple[HostileCase, Outcome]]) -> dict[str, list[Any]]:
    findings = {
        "five_xx": lambda o: o.five_xx,
        "hangs": lambda o: o.hang,
        "internal_errors": lambda o: o.internal_error,
        "protocol_errors": lambda o: o.protocol_error is not None,
    }
    return {name: [{"case": c.to_json(), "outcome": o.to_json()}
                   for c, o in results if found(o)][:MAX_REPRODUCERS]
            for name, found in findings.items()}
