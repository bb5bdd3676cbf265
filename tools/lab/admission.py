"""``admission``: TTFT deadlines under a load above capacity, with and without the gate.

The reference chapter's exercise 5: put a deadline gate in front of the batched engine
in place of the count of waiting requests. Hypothesis: with ``deadline_ms`` on every
request, the server refuses at once (429 ``deadline_unmeetable``, within 50 ms) what it
estimates it cannot start in time, and lets go what waited past its deadline anyway, so
that at least 95% of the requests it admits meet their deadline and the goodput (tokens/s
of requests that met it) holds; admitting all (only ``max_waiting``, a count) lets the
queue grow until nearly every request misses.

Procedure. Capacity: ``max_batch`` streams of ``--tokens`` greedy tokens (``ignore_eos``)
at once; the sustainable rate is their tokens/s over ``--tokens`` (requests/s), and the
deadline (``--deadline-ms``, by default ``DEADLINE_FACTOR`` times that burst's TTFT p50:
a burst of a full batch is the worst a server keeping up meets) is set from it. Then,
for each condition, open-loop Poisson arrivals (seeded) at ``--load`` (1.5) times the
sustainable rate for ``--seconds``, each a prompt of tools/prompts.txt with ``--tokens``
new tokens, the server idle before each:

* ``deadline``: every request carries ``deadline_ms``;
* ``admit_all``: none does; the server's ``max_waiting`` (256) is the only limit;
* ``waiting_limit``: none does, on a server whose ``max_waiting`` is ``max_batch``: the
  count-based gate the chapter had.

Every request's deadline is the same, so each condition is judged by it: a request met
it if its first token arrived within ``deadline_ms`` of its sending and it ended
normally. Summary per condition: ``offered``, ``admitted`` (200), ``refused`` (429),
``met_pct`` (of admitted), ``missed_waiting`` (ended by ``deadline_missed``),
``goodput_tokens_per_s`` (tokens of the requests that met the deadline over the window
from the first arrival to the last end), ``refusal_p50``/``refusal_p99``/``refusal_max``
(ms from sending to the refusal's answer), ``ttft_p50``/``ttft_p99`` of admitted
requests. Plot: the share of admitted requests that met the deadline and the goodput per
condition, and every request's TTFT (or refusal) against its arrival.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import trio

from streams import SSEParser
from tools.lab.common import Lab, Report, experiment, ms, pct

DEADLINE_FACTOR = 2.0  # the default deadline: this many times a full batch's TTFT p50
REFUSAL_GOAL_MS = 50.0
MET_GOAL_PCT = 95.0
CONDITIONS = ("deadline", "admit_all", "waiting_limit")
MAX_BATCH = 32  # the server's default max_batch (the lab does not change it)


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--load", type=float, default=1.5,
                        help="arrival rate over the sustainable rate (default 1.5)")
    parser.add_argument("--seconds", type=float, default=None,
                        help="arrivals last this long (default 20; --quick 1)")
    parser.add_argument("--tokens", type=int, default=None,
                        help="new tokens per request (default 128; --quick 32)")
    parser.add_argument("--deadline-ms", type=float, default=None,
                        help="the TTFT deadline (default: DEADLINE_FACTOR x a full "
                        "batch's TTFT p50)")


@dataclass
class Outcome:
    """One request: what came back and when (``time.perf_counter()`` seconds)."""

    sent_at: float
    status: int | None = None
    answered_at: float | None = None  # the response's head arrived
    first_token_at: float | None = None
    ended_at: float | None = None
    tokens: int = 0
    end: str | None = None  # "done", an error type, or "transport"
    error: dict[str, Any] = field(default_factory=dict)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.sent_at

    def met(self, deadline_s: float) -> bool:
        ttft = self.ttft_s
        return self.end == "done" and ttft is not None and ttft <= deadline_s

    def to_json(self, origin: float) -> dict[str, Any]:
        def at(t: float | None) -> float | None:
            return None if t is None else round((t - origin) * 1000, 2)

        return {"sent_ms": at(self.sent_at), "status": self.status,
                "answered_ms": at(self.answered_at), "ttft_ms": ms(self.ttft_s, 2),
                "ended_ms": at(self.ended_at), "tokens": self.tokens, "end": self.end,
                "error": self.error or None}


async def request_one(client: httpx.AsyncClient, body: dict[str, Any], out: Outcome) -> None:
    """POST /v1/stream and read it to its end into ``out``.

    Cancellation: closed by its owner: the response's ``async with`` closes it, and
    httpx (httpcore, shielded) closes its connection, as the body was not read to its
    end, so the server reads a client gone; ``out`` keeps what arrived, with
    ``ended_at`` set in the ``finally``.
    """
    parser = SSEParser()
    try:
        async with client.stream("POST", "/v1/stream", json=body) as response:
            out.status, out.answered_at = response.status_code, time.perf_counter()
            if response.status_code != 200:
                document = json.loads(await response.aread())
                out.error = document.get("error", {})
                out.end = out.error.get("type", f"http_{response.status_code}")
                return
            async for chunk in response.aiter_raw():
                now = time.perf_counter()
                for event in parser.feed(chunk):
                    if event.event == "token":
                        out.tokens += 1
                        if out.first_token_at is None:
                            out.first_token_at = now
                    elif event.event in ("done", "error"):
                        out.end = "done" if event.event == "done" else (
                            json.loads(event.data)["error"]["type"])
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        out.end = out.end or "transport"
        out.error = out.error or {"message": f"{type(exc).__name__}: {exc}"}
    finally:
        out.ended_at = time.perf_counter()


def make_client(url: str) -> httpx.AsyncClient:
    """A pool of keep-alive connections, each dropped after 1 s idle: httpx's default
    (5 s) is hypercorn's keep-alive timeout, and a POST sent on a connection the server
    is closing at that moment fails with no answer (seen once in the suite, the machine
    loaded by eight labs at once). A client must expire idle connections before the
    server does; a POST is not retried."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None,
                          keepalive_expiry=1.0)
    return httpx.AsyncClient(base_url=url, timeout=300.0, trust_env=False, limits=limits)


async def capacity(lab: Lab, url: str, streams: int, tokens: int) -> dict[str, Any]:
    """A full batch at once: its tokens/s, the sustainable rate and its TTFTs."""
    outcomes = [Outcome(0.0) for _ in range(streams)]
    async with make_client(url) as client, trio.open_nursery() as nursery:
        started = time.perf_counter()
        for out, prompt in zip(outcomes, lab.prompts(streams), strict=True):
            out.sent_at = started
            body = {"prompt": prompt, "max_new_tokens": tokens, "ignore_eos": True}
            nursery.start_soon(request_one, client, body, out)
    makespan = max(o.ended_at or started for o in outcomes) - started
    made = sum(o.tokens for o in outcomes)
    ttfts = [o.ttft_s for o in outcomes if o.ttft_s is not None]
    return {"streams": streams, "tokens_per_s": made / makespan,
            "rate_per_s": made / makespan / tokens, "makespan_s": makespan,
            "ttft_p50_s": pct(ttfts, 50), "ttft_p99_s": pct(ttfts, 99),
            "ended": [o.end for o in outcomes]}


async def offered_load(
    lab: Lab, url: str, arrivals: list[float], tokens: int, deadline_ms: float | None
) -> tuple[list[Outcome], float]:
    """Send one request at each arrival (seconds from now); the outcomes and the start."""
    prompts = lab.prompts(len(arrivals))
    outcomes: list[Outcome] = []
    async with make_client(url) as client, trio.open_nursery() as nursery:
        origin = time.perf_counter()
        for at, prompt in zip(arrivals, prompts, strict=True):
            await trio.sleep(max(origin + at - time.perf_counter(), 0.0))
            body: dict[str, Any] = {"prompt": prompt, "max_new_tokens": tokens,
                                    "ignore_eos": True}
            if deadline_ms is not None:
                body["deadline_ms"] = deadline_ms
            out = Outcome(time.perf_counter())
            outcomes.append(out)
            nursery.start_soon(request_one, client, body, out)
    return outcomes, origin


def judge(outcomes: list[Outcome], deadline_ms: float) -> dict[str, Any]:
    deadline_s = deadline_ms / 1000
    admitted = [o for o in outcomes if o.status == 200]
    refused = [o for o in outcomes if o.status == 429]
    met = [o for o in admitted if o.met(deadline_s)]
    refusal_ms = [(o.answered_at - o.sent_at) * 1000 for o in refused if o.answered_at]
    ttfts = [o.ttft_s for o in admitted if o.ttft_s is not None]
    start = min(o.sent_at for o in outcomes)
    end = max(o.ended_at or start for o in outcomes)
    return {
        "offered": len(outcomes),
        "admitted": len(admitted),
        "refused": len(refused),
        "refused_by": _count(o.end for o in refused),
        "met": len(met),
        "met_pct": round(100 * len(met) / len(admitted), 1) if admitted else None,
        "missed_waiting": sum(o.end == "deadline_missed" for o in admitted),
        "other_ends": _count(o.end for o in outcomes if o.status not in (200, 429)
                             or (o.status == 200 and o.end not in ("done", "deadline_missed"))),
        "goodput_tokens_per_s": round(sum(o.tokens for o in met) / (end - start), 1),
        "tokens_per_s": round(sum(o.tokens for o in admitted) / (end - start), 1),
        "refusal_p50": _round(pct(refusal_ms, 50)),
        "refusal_p99": _round(pct(refusal_ms, 99)),
        "refusal_max": _round(max(refusal_ms, default=None)),
        "ttft_p50": ms(pct(ttfts, 50)),
        "ttft_p99": ms(pct(ttfts, 99)),
    }


def _count(values: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for v in values:
        counts[str(v)] = counts.get(str(v), 0) + 1
    return counts


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def poisson_arrivals(lab: Lab, rate: float, seconds: float) -> list[float]:
    arrivals, t = [], lab.rng.expovariate(rate)
    while t < seconds:
        arrivals.append(t)
        t += lab.rng.expovariate(rate)
    return arrivals


@experiment("admission", "TTFT deadlines above capacity: deadline gate vs admit-all",
            arguments=arguments)
async def admission(lab: Lab) -> Report:
    tokens = lab.option("tokens", 128, 32)
    seconds = lab.option("seconds", 20.0, 1.0)  # quick: the mechanics, not a measure
    max_batch = int(lab.server_settings.get("max_batch") or MAX_BATCH)  # type: ignore[call-overload]
    load = lab.args.load
    results: dict[str, Any] = {}
    raw: dict[str, Any] = {}
    url = lab.url
    await capacity(lab, url, max_batch, tokens)  # warm-up: costs measured
    await lab.wait_idle()
    cap = await capacity(lab, url, max_batch, tokens)
    await lab.wait_idle()
    deadline_ms = lab.args.deadline_ms or round(
        DEADLINE_FACTOR * 1000 * (cap["ttft_p50_s"] or 1.0), 1)
    arrivals = poisson_arrivals(lab, load * cap["rate_per_s"], seconds)
    for condition in CONDITIONS[:2]:
        gate = deadline_ms if condition == "deadline" else None
        outcomes, origin = await offered_load(lab, url, arrivals, tokens, gate)
        results[condition] = judge(outcomes, deadline_ms)
        raw[condition] = [o.to_json(origin) for o in outcomes]
        results[condition]["stats"] = _deadline_stats(await lab.wait_idle())
    async with lab.server(max_waiting=max_batch) as url:
        await capacity(lab, url, max_batch, tokens)  # warm-up
        await lab.wait_idle(url)
        outcomes, origin = await offered_load(lab, url, arrivals, tokens, None)
        results["waiting_limit"] = judge(outcomes, deadline_ms)
        raw["waiting_limit"] = [o.to_json(origin) for o in outcomes]
    gated = results["deadline"]
    summary = {
        "deadline_ms": deadline_ms,
        "sustainable_rate_per_s": round(cap["rate_per_s"], 2),
        "offered_rate_per_s": round(load * cap["rate_per_s"], 2),
        "capacity_tokens_per_s": round(cap["tokens_per_s"], 1),
        "met_pct": {c: results[c]["met_pct"] for c in CONDITIONS},
        "goodput_tokens_per_s": {c: results[c]["goodput_tokens_per_s"] for c in CONDITIONS},
        "admitted": {c: results[c]["admitted"] for c in CONDITIONS},
        "refused": {c: results[c]["refused"] for c in CONDITIONS},
        "refusal_p99": gated["refusal_p99"],
        "refusal_max": gated["refusal_max"],
        "met_goal": (gated["met_pct"] or 0) >= MET_GOAL_PCT,
        "refusal_goal": gated["refusal_max"] is None or gated["refusal_max"] <= REFUSAL_GOAL_MS,
    }
    cap_json = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in cap.items()}
    return Report(summary=summary,
                  raw={"conditions": results, "capacity": cap_json, "requests": raw},
                  plot=lambda fig: draw(fig, results, raw, deadline_ms))


def _deadline_stats(stats: dict[str, Any]) -> dict[str, Any]:
    return {k: stats.get(k) for k in ("refused_deadline", "deadline_misses", "refused_waiting")}


def draw(fig: Any, results: dict[str, Any], raw: dict[str, Any], deadline_ms: float) -> None:
    left, right = fig.subplots(1, 2, width_ratios=[1, 2])
    names = list(results)
    met = [results[c]["met_pct"] or 0 for c in names]
    goodput = [results[c]["goodput_tokens_per_s"] for c in names]
    bars = left.bar(names, met, color=["tab:green", "tab:red", "tab:orange"][: len(names)])
    left.axhline(MET_GOAL_PCT, color="grey", linestyle="--", linewidth=1)
    left.set_ylabel("admitted requests that met the deadline (%)")
    left.set_ylim(0, 105)
    for bar, g, c in zip(bars, goodput, names, strict=True):
        left.annotate(f"{g:.0f} tok/s\n{results[c]['refused']} refused",
                      (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                      ha="center", va="bottom", fontsize=8)
    left.set_title("met the TTFT deadline; goodput")
    colours = {"deadline": "tab:green", "admit_all": "tab:red", "waiting_limit": "tab:orange"}
    for c in names:
        rows = raw[c]
        xs = [r["sent_ms"] / 1000 for r in rows if r["ttft_ms"] is not None]
        ys = [r["ttft_ms"] for r in rows if r["ttft_ms"] is not None]
        right.scatter(xs, ys, s=6, color=colours[c], label=f"{c}: TTFT")
        refused = [r for r in rows if r["status"] == 429]
        if refused:
            right.scatter([r["sent_ms"] / 1000 for r in refused],
                          [max(r["answered_ms"] - r["sent_ms"], 0.1) for r in refused],
                          s=6, marker="x", color=colours[c], label=f"{c}: refusal")
    right.axhline(deadline_ms, color="grey", linestyle="--", linewidth=1, label="deadline")
    right.set_yscale("log")
    right.set_xlabel("arrival (s)")
    right.set_ylabel("ms")
    right.set_title("time to first token (or to the refusal) per request")
    right.legend(fontsize=7, markerscale=2)
