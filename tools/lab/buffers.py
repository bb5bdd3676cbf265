"""``buffers``: how many bytes a client that reads nothing absorbs before the server's write blocks.

The chapter's "Where backpressure begins". Between the engine and a reader sit the
stream's queue, the server's write, the kernel's send buffer, the reader's receive
buffer; only a write that blocks tells the server that the reader is behind. This
measures where that starts, as the chapter did: a client connects and reads nothing at
all while the server writes events as fast as the connection accepts them.

Procedure. The server is the lab's (``_app.py``), which has the flood probe; with
``--url`` it must be one (``hypercorn -k trio tools.lab._asgi:app``). For each event
size (133 B, the chapter's token event; 1 KiB; 16 KiB; 64 KiB) and each repetition: a
raw socket sends ``POST /v1/lab/flood {"id", "event_bytes"}`` and never calls ``recv``;
the lab asks ``GET /v1/lab/flood/<id>`` on another connection until the flood reports
its write blocked (handed to hypercorn and not accepted for 0.2 s) and its count has not
moved for ``SETTLE_S`` more; that count is the figure. Then the socket is reset (RST) and the lab
waits for the flood to end ``cancelled``: the disconnect must reach a blocked writer.

``bytes_accepted`` counts SSE bytes as the application wrote them (see ``_flood.py``);
hypercorn adds the response headers and, per write, a chunk header and two CRLFs
(``wire_bytes`` adds the chunk framing). For scale, one ordinary stream of 64 tokens
(greedy, ``ignore_eos``) gives this server's bytes per token, and a 256-token answer
(the chapter's largest budget) is ``256 * bytes_per_token``.

Summary: ``bytes_accepted_133``, ``_1024``, ``_16384``, ``_65536`` (median over
repetitions, bytes), ``bytes_accepted_range`` (min and max per size),
``bytes_per_token``, ``stream_256_bytes``, ``ratio_to_256_token_stream`` (the smallest
median over ``stream_256_bytes``: how many whole 256-token answers fit in the buffers
before a non-reader is felt), ``floods_released``/``floods``. Plot: bars per event size.
"""

from __future__ import annotations

import argparse
import uuid
from pathlib import Path
from typing import Any

import trio

from tools.lab._raw import RawStream
from tools.lab.common import Lab, LabError, Report, experiment, median, spread
from tools.load_runner import run_streams
from tools.records import StreamRequest

EVENT_SIZES = (133, 1024, 16384, 65536)
SETTLE_S = 0.3  # after "blocked": the count must stay put this long
POLL_S = 0.05
FLOOD_TIMEOUT_S = 60.0  # a flood that never blocks (a huge buffer) is reported, not waited on
STREAM_256_TOKENS = 256


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", type=int, nargs="+", help=f"event bytes, default {EVENT_SIZES}")
    parser.add_argument("--repetitions", type=int, help="default 3 (quick 1)")


@experiment(
    "buffers",
    "bytes a client that reads nothing absorbs before the server's write blocks",
    arguments=arguments,
)
async def buffers(lab: Lab) -> Report:
    sizes = list(lab.args.sizes or EVENT_SIZES)
    repetitions = lab.option("repetitions", 3, 1)
    await _require_lab_routes(lab)

    stream = await run_streams(
        lab.url, [StreamRequest(lab.prompts(1)[0], 64, True)], progress=False
    )
    record = stream.records[0]
    bytes_per_token = record.bytes / record.tokens if record.tokens else None
    stream_256 = round(STREAM_256_TOKENS * bytes_per_token) if bytes_per_token else None

    runs = []
    for rep in range(repetitions):
        for size in sizes:
            runs.append({"rep": rep, **await _one_flood(lab, size)})

    medians = {s: median([r["bytes_accepted"] for r in runs if r["event_bytes"] == s])
               for s in sizes}
    smallest = min((m for m in medians.values() if m is not None), default=None)
    summary: dict[str, Any] = {
        **{f"bytes_accepted_{s}": _int(medians[s]) for s in sizes},
        "bytes_accepted_range": {
            s: spread([r["bytes_accepted"] for r in runs if r["event_bytes"] == s]) for s in sizes
        },
        "bytes_per_token": None if bytes_per_token is None else round(bytes_per_token, 1),
        "stream_256_bytes": stream_256,
        "ratio_to_256_token_stream": (
            round(smallest / stream_256, 1) if smallest is not None and stream_256 else None
        ),
        "ratio_per_size": {
            s: round(m / stream_256, 1) if m is not None and stream_256 else None
            for s, m in medians.items()
        },
        "floods": len(runs),
        "floods_blocked": sum(r["blocked"] for r in runs),
        "floods_released": sum(r["end"] == "cancelled" for r in runs),
        "repetitions": repetitions,
    }
    raw = {"runs": runs, "kernel": _kernel_buffers(), "stream": stream.to_json()}
    return Report(summary, raw, plot=lambda fig: _draw(fig, sizes, runs, stream_256))


async def _require_lab_routes(lab: Lab) -> None:
    async with lab.client() as client:
        response = await client.post(
            "/v1/lab/flood", json={"id": f"probe-{uuid.uuid4().hex[:8]}", "event_bytes": 8,
                                   "max_bytes": 8}
        )
    if response.status_code != 200:
        raise LabError(
            f"POST /v1/lab/flood answered {response.status_code}: the server must be the "
            "lab's, hypercorn -k trio tools.lab._asgi:app (the lab starts one without --url)"
        )


async def _one_flood(lab: Lab, size: int) -> dict[str, Any]:
    """One non-reading client flooded with ``size``-byte events; its figures."""
    flood_id = f"buffers-{size}-{uuid.uuid4().hex[:8]}"
    silent = RawStream(lab.url)
    status: dict[str, Any] = {}
    settled: dict[str, Any] | None = None
    try:
        await silent.post("/v1/lab/flood", {"id": flood_id, "event_bytes": size})
        async with lab.client() as client:
            with trio.move_on_after(FLOOD_TIMEOUT_S):
                while True:
                    status = await _status(client, flood_id)
                    if status.get("blocked"):
                        await trio.sleep(SETTLE_S)
                        later = await _status(client, flood_id)
                        if later["bytes_accepted"] == status["bytes_accepted"]:
                            settled = later
                            break
                    elif status.get("state") == "ended":
                        break  # a bound ended it first: it never blocked
                    await trio.sleep(POLL_S)
            silent.close_rst()
            with trio.move_on_after(10):
                while status.get("state") != "ended":
                    await trio.sleep(POLL_S)
                    status = await _status(client, flood_id)
    finally:
        if silent.closed_at is None:
            silent.close_rst()
    figures = settled or status
    accepted = figures.get("bytes_accepted")
    events = figures.get("events_accepted") or 0
    return {
        "event_bytes": size,
        "flood_id": flood_id,
        "blocked": settled is not None,
        "bytes_accepted": accepted if settled is not None else None,
        "events_accepted": events,
        "wire_bytes": None if accepted is None else accepted + events * (len(f"{size:x}") + 4),
        "seconds_to_block": figures.get("accepting_s"),
        "end": status.get("end") if status.get("state") == "ended" else None,
        "status_at_end": status,
    }


async def _status(client: Any, flood_id: str) -> dict[str, Any]:
    response = await client.get(f"/v1/lab/flood/{flood_id}")
    if response.status_code == 404:
        return {}  # the body has not started yet
    response.raise_for_status()
    result: dict[str, Any] = response.json()
    return result


def _int(value: float | None) -> int | None:
    return None if value is None else round(value)


def _kernel_buffers() -> dict[str, str]:
    """Linux's TCP buffer settings (min, default, max): the figures depend on them."""
    found = {}
    for name in ("ipv4/tcp_rmem", "ipv4/tcp_wmem", "core/rmem_max", "core/wmem_max"):
        path = Path("/proc/sys/net") / name
        if path.exists():
            found[name] = path.read_text().strip()
    return found


def _draw(fig: Any, sizes: list[int], runs: list[dict[str, Any]], stream_256: int | None) -> None:
    ax = fig.subplots()
    labels = [f"{s} B" if s < 1024 else f"{s // 1024} KiB" for s in sizes]
    values = {s: [r["bytes_accepted"] / 1024 for r in runs
                  if r["event_bytes"] == s and r["bytes_accepted"] is not None] for s in sizes}
    heights = [median(values[s]) or 0.0 for s in sizes]
    ax.bar(range(len(sizes)), heights, color="tab:blue", alpha=0.6, label="median")
    for i, s in enumerate(sizes):
        ax.scatter([i] * len(values[s]), values[s], color="black", s=14, zorder=3,
                   label="repetitions" if i == 0 else None)
    if stream_256:
        ax.axhline(stream_256 / 1024, color="tab:red", linestyle="--",
                   label=f"a 256-token stream ({stream_256 / 1024:.0f} KiB)")
    ax.set_xticks(range(len(sizes)), labels)
    ax.set_xlabel("event size")
    ax.set_ylabel("KiB accepted before the write blocked")
    ax.set_title("a client that reads nothing: what the server hands off before it blocks")
    ax.grid(axis="y", alpha=0.3)
    ax.legend()
