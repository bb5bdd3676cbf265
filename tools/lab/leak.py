"""``leak``: 300 streams whose clients leave in every way; afterwards nothing may be left.

The chapter's leak test ("When the client goes away"). Cleanup is checked by the state of
the server afterwards, not by its still being up: the cache whole, no stream registered,
every admitted sequence released exactly once, no error in the hub. And what leaving
cost: how many tokens the engine made for the streams whose clients left early, per
token those clients read.

Procedure. The server has a batch limit of 8 (``STREAMSCOPE_MAX_BATCH=8``), so most
streams wait for a slot. 300 streams (the prompts in turn; greedy, ``ignore_eos``,
``max_new_tokens`` drawn from 48 to 64) are sent from 48 concurrent clients, each on its
own raw socket, client ``k`` taking streams ``k, k + 48, ...`` one after another. Each
stream's behaviour is drawn with ``lab.rng``:

* 35% read to the end;
* 50% leave after 0 to 40 token events (0: right after the start event, usually still
  waiting for a slot), by FIN or RST (half each);
* 15% are slow readers (read a chunk, sleep 0.25 s) that leave after 3 or 10 tokens, by
  FIN or RST.

While they run, ``/stats`` is sampled every 0.25 s. Afterwards the lab waits for the
server to be idle and reads ``/stats`` (the last sample) and every request's
``GET /v1/requests/<id>``.

Summary: ``blocks_leaked`` (blocks_total - blocks_free), ``double_releases``
(releases beyond admitted, plus hub step errors: the engine's release raises on a second
release, which would fail a step), ``sequences_unreleased`` (admitted beyond releases),
``streams_registered_after`` (streams_open), ``engine_requests_after`` (submitted, not
finished), ``tokens_generated_per_token_read`` (for the streams that left early: the sum
of their ``completion_tokens`` over the sum of the tokens their clients read; the
chapter's target is at most 1.3-1.4), ``streams``, ``left_early``,
``finish_records`` (requests the server could account for), ``finish_reasons``,
``never_admitted`` (early leavers with no token made), ``makespan_s``. Plot: the
server's blocks and streams over the run, and tokens made against tokens read.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any

import trio

from tools.lab._raw import RawStream
from tools.lab.common import Lab, Report, experiment

MAX_BATCH = 8
SAMPLE_S = 0.25
SAMPLED = ("blocks_free", "blocks_total", "running", "waiting", "streams_open", "releases")


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--streams", type=int, help="default 300 (quick 40)")
    parser.add_argument("--clients", type=int, help="default 48 (quick 12)")


@dataclass(frozen=True)
class Plan:
    """What one stream's client does."""

    index: int
    prompt: str
    max_new_tokens: int
    kind: str  # "full", "leave" or "slow"
    leave_after: int | None  # tokens read before leaving (None: read to the end)
    way: str | None  # "fin" or "rst"


@experiment(
    "leak",
    "300 streams leaving by FIN, RST or slowly: blocks, streams and releases afterwards",
    server={"max_batch": MAX_BATCH},
    arguments=arguments,
)
async def leak(lab: Lab) -> Report:
    count = lab.option("streams", 300, 40)
    clients = lab.option("clients", 48, 12)
    token_range = lab.pick((48, 64), (16, 24))
    leave_range = lab.pick((0, 40), (0, 12))
    slow_after = lab.pick((3, 10), (3, 6))
    pause_s = lab.pick(0.25, 0.05)
    prompts = lab.prompts()
    plans = []
    for i in range(count):
        draw = lab.rng.random()
        tokens = lab.rng.randint(*token_range)
        way = lab.rng.choice(("fin", "rst"))
        if draw < 0.35:
            plans.append(Plan(i, prompts[i % len(prompts)], tokens, "full", None, None))
        elif draw < 0.85:
            leave = lab.rng.randint(*leave_range)
            plans.append(Plan(i, prompts[i % len(prompts)], tokens, "leave", leave, way))
        else:
            leave = lab.rng.choice(slow_after)
            plans.append(Plan(i, prompts[i % len(prompts)], tokens, "slow", leave, way))

    before = await lab.wait_idle()
    samples: list[dict[str, Any]] = []
    streams: list[RawStream | None] = [None] * count
    started = time.perf_counter()

    async def client_task(k: int) -> None:
        for plan in plans[k::clients]:
            streams[plan.index] = await _one_stream(lab.url, plan, pause_s)

    async with trio.open_nursery() as monitor:
        monitor.start_soon(_sample, lab, samples, started)
        async with trio.open_nursery() as nursery:
            for k in range(min(clients, count)):
                nursery.start_soon(client_task, k)
        makespan = time.perf_counter() - started
        monitor.cancel_scope.cancel(reason="every client is done")

    await lab.wait_idle()
    await trio.sleep(0.2)  # idle by its counts; let the last FinishEvents be routed
    after = await lab.stats()
    samples.append({"t_s": round(time.perf_counter() - started, 3),
                    **{k: after.get(k) for k in SAMPLED}})
    records: dict[str, dict[str, Any]] = {}
    async with lab.client() as http:
        for stream in streams:
            if stream is not None and stream.request_id is not None:
                response = await http.get(f"/v1/requests/{stream.request_id}")
                if response.status_code == 200:
                    records[stream.request_id] = response.json()
    rows = [_row(plan, stream, records) for plan, stream in zip(plans, streams, strict=True)]
    early = [r for r in rows if r["left_early"]]
    read = sum(r["tokens_read"] for r in early)
    made = sum(r["completion_tokens"] or 0 for r in early)
    admitted, releases = after.get("admitted"), after.get("releases")
    step_errors = after.get("step_errors") or 0
    summary: dict[str, Any] = {
        "blocks_leaked": after["blocks_total"] - after["blocks_free"],
        "double_releases": max(0, (releases or 0) - (admitted or 0)) + step_errors,
        "sequences_unreleased": max(0, (admitted or 0) - (releases or 0)),
        "streams_registered_after": after["streams_open"],
        "engine_requests_after": after.get("engine_requests"),
        "tokens_generated_per_token_read": round(made / read, 2) if read else None,
        "streams": count,
        "left_early": len(early),
        "finish_records": len(records),
        "finish_reasons": _count(r["finish_reason"] for r in rows),
        "never_admitted": sum(r["completion_tokens"] == 0 for r in early),
        "tokens_read_early": read,
        "tokens_generated_early": made,
        "client_errors": sum(r["terminal"] not in (None, "done") for r in rows),
        "admitted": (admitted or 0) - (before.get("admitted") or 0),
        "releases": (releases or 0) - (before.get("releases") or 0),
        "events_dropped": after.get("events_dropped"),
        "makespan_s": round(makespan, 2),
        "clients": clients,
    }
    raw = {"streams": rows, "samples": samples, "stats_before": before, "stats_after": after}
    return Report(summary, raw, plot=lambda fig: _draw(fig, samples, early))


async def _one_stream(url: str, plan: Plan, pause_s: float) -> RawStream:
    """One stream, read and left as ``plan`` says. Cancellation: the socket is reset."""
    stream = RawStream(url)
    try:
        await stream.post("/v1/stream", {"prompt": plan.prompt, "ignore_eos": True,
                                         "max_new_tokens": plan.max_new_tokens})
        if plan.kind == "full":
            await stream.read_to_end()
        else:
            assert plan.leave_after is not None and plan.way is not None
            after = plan.leave_after
            if plan.kind == "slow":
                while stream.request_id is None or stream.tokens < after:
                    if not await stream.read_chunk():
                        break
                    await trio.sleep(pause_s)
            else:
                await stream.read_until(lambda s: s.request_id is not None and s.tokens >= after)
            await stream.close(plan.way)
    finally:
        if stream.closed_at is None:
            stream.close_rst()
    return stream


async def _sample(lab: Lab, samples: list[dict[str, Any]], started: float) -> None:
    """Sample /stats until cancelled."""
    async with lab.client() as client:
        while True:
            stats = await lab.stats(client=client)
            samples.append({"t_s": round(time.perf_counter() - started, 3),
                            **{k: stats.get(k) for k in SAMPLED}})
            await trio.sleep(SAMPLE_S)


def _row(plan: Plan, stream: RawStream | None, records: dict[str, dict[str, Any]]) -> dict[
    str, Any
]:
    record = records.get(stream.request_id or "") if stream is not None else None
    terminal = None if stream is None else stream.terminal
    return {
        "index": plan.index,
        "kind": plan.kind,
        "way": plan.way,
        "leave_after": plan.leave_after,
        "max_new_tokens": plan.max_new_tokens,
        "request_id": None if stream is None else stream.request_id,
        "tokens_read": 0 if stream is None else stream.tokens,
        "terminal": terminal,
        # Left before its terminal event: the engine still held the request.
        "left_early": plan.kind != "full" and terminal is None,
        "finish_reason": None if record is None else record["finish_reason"],
        "completion_tokens": None if record is None else record["completion_tokens"],
    }


def _count(values: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for value in values:
        counts[str(value)] = counts.get(str(value), 0) + 1
    return counts


def _draw(fig: Any, samples: list[dict[str, Any]], early: list[dict[str, Any]]) -> None:
    timeline, waste = fig.subplots(1, 2)
    t = [s["t_s"] for s in samples]
    total = samples[0]["blocks_total"] if samples else 0
    timeline.plot(t, [total - (s["blocks_free"] or 0) for s in samples], label="blocks in use")
    timeline.plot(t, [s["streams_open"] for s in samples], label="streams registered")
    timeline.plot(t, [s["running"] for s in samples], label="sequences running")
    timeline.plot(t, [s["waiting"] for s in samples], label="sequences waiting")
    timeline.set_xlabel("time (s)")
    timeline.set_title("the server during the run (ends at zero)")
    timeline.legend()
    timeline.grid(alpha=0.3)
    xs = [r["tokens_read"] for r in early]
    ys = [r["completion_tokens"] or 0 for r in early]
    waste.scatter(xs, ys, s=12, alpha=0.6)
    top = max(xs + ys + [1])
    waste.plot([0, top], [0, top], color="grey", linestyle="--", label="made = read")
    waste.set_xlabel("tokens the client read")
    waste.set_ylabel("tokens the engine made")
    waste.set_title(f"{len(early)} streams whose clients left early")
    waste.legend()
    waste.grid(alpha=0.3)
