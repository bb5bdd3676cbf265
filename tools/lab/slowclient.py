"""``slowclient``: what one, two or four slow readers among eight cost, under each policy.

The chapter's "A client that cannot keep up". A policy decides who pays for a reader that
cannot keep up: everyone (naive: the step loop waits for it), memory (unbounded), the
slow request's own slot and cache (pause), or the slow request itself (drop; pause-drop
pauses first). The requirement: one slow reader must not hold up the others.

Backpressure is made real with a laboratory device, stated as one: the server pads every
token event with a 64 KiB SSE comment (``STREAMSCOPE_LAB_PAD_BYTES=65536``), so a
64-token stream is about 4 MiB, far more than the socket buffers between the server and
a reader that does not read (``python -m tools.lab buffers``). Queue limit 8 and stall
timeout 0.25 s, as in the chapter (``STREAMSCOPE_QUEUE_LIMIT``,
``STREAMSCOPE_STALL_TIMEOUT_S``); the lab starts its server so; with ``--url`` the server
must have been started so.

Procedure. For each policy, on a server of its own started with that policy
(``STREAMSCOPE_POLICY``; ``naive`` is no policy of the service but the lab's device,
``naive.py``, which the lab installs in its server; a request may not pick ``unbounded``
or ``pause`` by default, see ``STREAMSCOPE_REQUEST_POLICIES``), and k = 0, 1, 2, 4 slow
readers: eight streams of 64 tokens (greedy, ``ignore_eos``, the first eight prompts),
each on its own raw socket, connected first and sent together. Streams 0..k-1 are slow:
read one chunk (one ``recv`` of at most 16 KiB), sleep 0.25 s, repeat; the others read
as fast as they can (``recv`` of 64 KiB, what httpx reads at a time).

Why 16 KiB reads. A slow reader is slow relative to the engine. The chapter's reader took
up to 64 KiB per 0.25 s (256 KiB/s) from an engine making about 100 tokens/s per stream
on a GPU (6 MiB/s padded): 25 times slower. The embedded model on this CPU makes about 4
tokens/s per stream at a batch of eight (260 ms steps; ``overlap``), 256 KiB/s padded,
which a 64 KiB reader keeps up with. 16 KiB per 0.25 s (about one token a second) makes
it about four times slower than the engine; ``--read-bytes`` changes it. The quick form
(tiny model, fast steps) keeps 64 KiB. Every client reads until its terminal event. Then
``GET /v1/lab/requests/<id>`` gives when each sequence left the engine (``finished_at``,
the server's wall clock, minus the client's wall time at sending). The server is idle
before each condition.

Per condition: the healthy streams' completion time (first request sent to the last
healthy stream's terminal event) and their gaps between tokens (p50, p99 over all healthy
gaps); for each slow stream, when its sequence left the engine, what its client finally
received (done, or an error event of type slow_client) and after how long, and how many
tokens it read.

Summary: ``healthy_slowdown`` per policy (completion time with one slow reader over that
with none; the requirement is at most 1.2, ``slowdown_within_1_2``, for all but naive),
``slow_released_s`` per policy (median over every slow stream of k = 1, 2, 4 of when its
sequence left the engine, s from its request), ``slow_received`` per policy (terminal
events of the slow clients), ``healthy_completion_s`` and ``healthy_gap_p99_ms`` per
policy and k, ``bytes_per_token`` (about 64 KiB when the padding is on), ``repetitions``.
Each condition runs once by default (``--repetitions``): on this CPU a naive, unbounded
or pause condition lasts as long as its slow reader takes to read 4 MiB (about a
minute), so the full run cuts repetitions, not conditions; the summary says so.
Plot: healthy completion time and gap p99 against k.
"""

from __future__ import annotations

import argparse
import itertools
from collections import Counter
from typing import Any

import trio

from tools.lab._raw import RawStream, finish_record
from tools.lab.common import Lab, Report, experiment, median, ms, pct, spread
from tools.lab.naive import LAB_POLICIES

POLICIES = LAB_POLICIES  # naive (the lab's), unbounded, pause, drop, pause-drop
SLOW_READERS = (0, 1, 2, 4)
STREAMS = 8
PAD_BYTES = 65536
SLOWDOWN_TARGET = 1.2


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policies", nargs="+", choices=POLICIES, help="default: all five")
    parser.add_argument("--slow-readers", type=int, nargs="+",
                        help=f"default {SLOW_READERS} (quick 0 1)")
    parser.add_argument("--max-new-tokens", type=int, help="default 64 (quick 8)")
    parser.add_argument("--pause-s", type=float, help="a slow reader's sleep, default 0.25 "
                        "(quick 0.1)")
    parser.add_argument("--read-bytes", type=int, help="a slow reader's recv size, default "
                        "16384 (quick 65536)")
    parser.add_argument("--repetitions", type=int, help="default 1")


@experiment(
    "slowclient",
    "one, two or four slow readers among eight: what the others pay, under each policy",
    server={"lab_pad_bytes": PAD_BYTES, "queue_limit": 8, "stall_timeout_s": 0.25},
    arguments=arguments,
    own_servers=True,
)
async def slowclient(lab: Lab) -> Report:
    policies = list(lab.args.policies or POLICIES)
    levels = sorted(set(lab.args.slow_readers or lab.pick(SLOW_READERS, (0, 1))))
    tokens = lab.option("max_new_tokens", 64, 8)
    pause_s = lab.option("pause_s", 0.25, 0.1)
    read_bytes = lab.option("read_bytes", 16384, 65536)
    repetitions = lab.option("repetitions", 1, 1)
    prompts = lab.prompts(STREAMS)

    runs: list[dict[str, Any]] = []
    for policy in policies:
        async with lab.server(policy=policy) as url:
            warm = RawStream(url)
            await warm.post("/v1/stream", {"prompt": prompts[0], "max_new_tokens": 2})
            await warm.read_to_end()
            warm.close_rst()
            for rep, k in itertools.product(range(repetitions), levels):
                await lab.wait_idle(url)
                run = await one_condition(
                    lab, url, prompts, policy, k, tokens, pause_s, read_bytes
                )
                runs.append({"rep": rep, **run})
                if lab.progress:
                    print(f"  {policy:<10} k={k}: healthy {run['healthy_completion_s']} s, "
                          f"gap p99 {run['healthy_gap_p99_ms']} ms, slow released "
                          f"{run['slow_released_s']} s", flush=True)

    def figure(policy: str, k: int, key: str) -> float | None:
        return median([r[key] for r in runs if r["policy"] == policy and r["k"] == k])

    completion = {p: {k: figure(p, k, "healthy_completion_s") for k in levels} for p in policies}
    slowdown = {p: _ratio(completion[p].get(1), completion[p].get(0)) for p in policies}
    slow_streams = {p: [s for r in runs if r["policy"] == p for s in r["slow"]] for p in policies}
    zero = [r for r in runs if r["k"] == 0]
    summary: dict[str, Any] = {
        "healthy_slowdown": slowdown,
        "slowdown_within_1_2": {
            p: None if v is None else v <= SLOWDOWN_TARGET for p, v in slowdown.items()
        },
        "slow_released_s": {
            p: _round(median([s["released_s"] for s in slow_streams[p]])) for p in policies
        },
        "slow_released_s_range": {
            p: spread([s["released_s"] for s in slow_streams[p]]) for p in policies
        },
        "slow_read_end_s": {
            p: _round(median([s["read_end_s"] for s in slow_streams[p]])) for p in policies
        },
        "slow_received": {p: dict(Counter(str(s["terminal"]) for s in slow_streams[p]))
                          for p in policies},
        "healthy_completion_s": {p: {k: _round(v) for k, v in c.items()}
                                 for p, c in completion.items()},
        "healthy_gap_p99_ms": {
            p: {k: figure(p, k, "healthy_gap_p99_ms") for k in levels} for p in policies
        },
        "bytes_per_token": median([r["bytes_per_token"] for r in zero]),
        "errors": sum(r["healthy_errors"] for r in runs),
        "streams": STREAMS,
        "max_new_tokens": tokens,
        "pause_s": pause_s,
        "read_bytes": read_bytes,
        "repetitions": repetitions,
        "note": (
            f"{repetitions} repetition(s) of every condition"
            + (": cut from the chapter's design to fit a CPU run (each slow condition lasts "
               "as long as its slow reader)" if repetitions < 3 and not lab.quick else "")
        ),
    }
    return Report(summary, {"runs": runs}, plot=lambda fig: _draw(fig, policies, levels, runs))


async def one_condition(
    lab: Lab, url: str, prompts: list[str], policy: str, k: int, tokens: int, pause_s: float,
    read_bytes: int, extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Eight streams on the server at ``url`` (whose policy is ``policy``), the first ``k``
    of them read slowly; ``extra``: more fields of every request body (the logprobs
    experiment's)."""
    clients = [RawStream(url) for _ in prompts]
    async with trio.open_nursery() as nursery:
        for client in clients:
            nursery.start_soon(client.connect)
    go = trio.Event()

    async def run(i: int, client: RawStream) -> None:
        await go.wait()
        body = {"prompt": prompts[i], "max_new_tokens": tokens, "ignore_eos": True,
                "temperature": 0.0, **(extra or {})}
        await client.post("/v1/stream", body)
        if i < k:
            await client.read_slowly(pause_s, read_bytes)
        else:
            await client.read_to_end()

    try:
        async with trio.open_nursery() as nursery:
            for i, client in enumerate(clients):
                nursery.start_soon(run, i, client)
            go.set()
    finally:
        for client in clients:
            client.close_rst()

    healthy, slow = clients[k:], clients[:k]
    first_sent = min(c.sent_at for c in clients if c.sent_at is not None)
    ends = [c.finished_at for c in healthy if c.finished_at is not None]
    gaps = [g for c in healthy for g in c.gaps_s()]
    slow_figures = []
    async with lab.client(url) as http:
        for client in slow:
            record = await finish_record(http, client.request_id or "")
            slow_figures.append({
                "request_id": client.request_id,
                "released_s": round(record["finished_at"] - (client.sent_wall or 0.0), 3),
                "finish_reason": record["finish_reason"],
                "completion_tokens": record["completion_tokens"],
                "terminal": client.terminal,
                "tokens_read": client.tokens,
                "read_end_s": round((client.finished_at or 0.0) - (client.sent_at or 0.0), 3),
            })
    body_bytes = sum(c.body_bytes for c in healthy)
    healthy_tokens = sum(c.tokens for c in healthy)
    return {
        "policy": policy,
        "k": k,
        "healthy_completion_s": round(max(ends) - first_sent, 3) if ends else None,
        "healthy_gap_p50_ms": ms(pct(gaps, 50)),
        "healthy_gap_p99_ms": ms(pct(gaps, 99)),
        "healthy_errors": sum(c.terminal != "done" for c in healthy),
        "bytes_per_token": round(body_bytes / healthy_tokens) if healthy_tokens else None,
        "slow_released_s": _round(median([s["released_s"] for s in slow_figures])),
        "slow": slow_figures,
        "streams": [c.to_json(first_sent) for c in clients],
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a is not None and b else None


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def _draw(fig: Any, policies: list[str], levels: list[int], runs: list[dict[str, Any]]) -> None:
    completion, gaps = fig.subplots(1, 2)
    for policy in policies:
        mine = [r for r in runs if r["policy"] == policy]
        for axis, key in ((completion, "healthy_completion_s"), (gaps, "healthy_gap_p99_ms")):
            ys = [median([r[key] for r in mine if r["k"] == k]) for k in levels]
            axis.plot(levels, ys, marker="o", label=policy)
    from matplotlib.ticker import ScalarFormatter

    for axis, label in ((completion, "healthy streams' completion time (s)"),
                        (gaps, "healthy streams' gap p99 (ms)")):
        axis.set_yscale("log")
        axis.yaxis.set_major_formatter(ScalarFormatter())
        axis.yaxis.set_minor_formatter(ScalarFormatter())
        axis.set_xticks(levels)
        axis.set_xlabel("slow readers among eight")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
        axis.legend()
    completion.set_title("what the healthy streams pay")
    gaps.set_title("the tail of their gaps between tokens")
