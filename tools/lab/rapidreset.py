"""``rapidreset``: HTTP/2 floods (CVE-2023-44487, CVE-2025-8671 and their kin), and what
other clients pay.

A rapid-reset client opens a stream and resets it at once, in a loop, on one connection:
the server does the work of starting each request, the client none of waiting for it.
MadeYouReset (CVE-2025-8671) does the same without sending a reset: a WINDOW_UPDATE that
overflows the stream's window makes the server reset the stream itself. PING and SETTINGS
floods make the server answer every frame. ``app/edge/h2_floods.py`` gives each
connection budgets for all of them (a reset counts whoever sent it) and answers a flood
with GOAWAY ``ENHANCE_YOUR_CALM`` (issues 25 and 33); this measures that bound and its
cost to the others.

Procedure. The attacker is ``python -m tools.h2flood`` in a process of its own (its
work is neither the server's nor the measuring client's), in the clear with prior
knowledge (h2c, as ``hypercorn -k trio app:app`` serves without a certificate). It
builds one flood of each kind, ``--units`` each (default 10,000; quick 2,000): ``reset``,
HEADERS + DATA (a POST to /v1/stream) + RST_STREAM; ``madeyoureset``, HEADERS + DATA +
a WINDOW_UPDATE of 2^31-1 on the stream; ``ping``; ``settings``. Then
``--rounds`` rounds (default 5; quick 1) of five runs. In each run ``VICTIMS`` streams on
HTTP/1.1 connections of their own (greedy, ``ignore_eos``, ``--tokens`` tokens: default
64, quick 24) are read to their ends, while the attacker does one of (``CONDITIONS``):

* ``quiet``: nothing;
* ``spread``: the issue's attack: one flood of each kind, each on a connection of its
  own, spread over a quiet run's length (that of a warm-up run, not counted);
* ``reconnect``: floods of the three kinds in turn, back to back for as long: it hangs
  up at each GOAWAY and connects again at once, as an attacker would;
* ``madeyoureset``: MadeYouReset floods, back to back for as long, reconnecting likewise;
* ``burn``: no traffic; it keeps one core busy for as long. The control: on a machine
  with few cores an attacker's process takes CPU from the server whatever it sends, and
  this is what that alone costs the victims.

Summary: ``gap_p99_ms_<condition>`` (the median over the rounds of the victims' token gap
p99), ``p99_ratio_<attack>`` (over quiet; the issue's goal, for ``spread``: at most
``P99_GOAL``), ``floods`` and ``floods_enhance_your_calm`` (ended by that GOAWAY),
``floods_per_s_reconnect``; for each kind (``madeyoureset`` included)
``goaway_ms_<kind>`` (median, from the flood connection's start), ``read_share_<kind>``
(the median share of the flood's bytes the socket had taken when the GOAWAY came; the
attacker sends no more after it) and, for pings, ``ping_acks_max`` (answered PINGs, at
most ``PING_BURST``); ``attacker_streams_started`` (requests the hub opened beyond the
victims') and ``attacker_sequences_admitted`` (sequences the engine admitted beyond the
victims'), and ``attacker_streams_started_<attack>`` (the same, of the runs under one
attack; read from ``/stats`` around each run, so a request the server was still
cancelling when a run ended counts in the next); ``floods_madeyoureset`` (floods sent)
and ``server_resets_madeyoureset`` (the RST_STREAMs one such flood drew from the server:
median); ``victims_complete`` (every victim got all of its tokens and ``done``).
Plot: the victims' gaps under each condition, as distributions.
"""

from __future__ import annotations

import argparse
from functools import partial
from typing import Any

import h2.errors
import trio

from app.edge import h2_floods
from tools.h2flood import BUILT, Attacker
from tools.lab._raw import RawStream, host_port
from tools.lab.common import Lab, Report, experiment, median, ms, pct, plot_gap_cdfs

VICTIMS = 4
P99_GOAL = 1.5
ATTACKS = ("spread", "reconnect", "madeyoureset", "burn")  # tools.h2flood's kinds of round
CONDITIONS = ("quiet", *ATTACKS)
LABELS = {"quiet": "quiet", "spread": "one flood of each kind, spread over the run",
          "reconnect": "floods back to back, reconnecting",
          "madeyoureset": "MadeYouReset floods back to back, reconnecting",
          "burn": "control: a process keeping one core busy"}
ENHANCE_YOUR_CALM = int(h2.errors.ErrorCodes.ENHANCE_YOUR_CALM)


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, help="quiet and loud runs, each (default 5)")
    parser.add_argument("--units", type=int, help="per flood (default 10,000)")
    parser.add_argument("--tokens", type=int, help="per victim stream (default 64)")


@experiment("rapidreset",
            "HTTP/2 rapid-reset, MadeYouReset, PING and SETTINGS floods: GOAWAY, what they "
            "start, and "
            "other clients' gap p99 against a quiet run",
            arguments=arguments)
async def rapidreset(lab: Lab) -> Report:
    rounds = lab.option("rounds", 5, 1)
    units = lab.option("units", 10_000, 2_000)
    tokens = lab.option("tokens", 64, 24)
    prompts = lab.prompts(VICTIMS)
    host, port = host_port(lab.url)

    await lab.wait_idle()
    warm_up = await _victims(lab.url, prompts, tokens)
    before = await lab.wait_idle()
    runs: list[dict[str, Any]] = []
    async with Attacker.running(host, port, warm_up["duration_s"], units=units) as attacker:
        for index in range(rounds):
            for condition in CONDITIONS:
                attack = None if condition == "quiet" else partial(attacker.start_round,
                                                                   condition)
                opened = (await lab.stats()).get("opened") or 0
                run = await _victims(lab.url, prompts, tokens, attack)
                floods = [] if attack is None else await attacker.round_results()
                opened = int((await lab.stats()).get("opened") or 0) - int(opened)
                runs.append({"round": index, "condition": condition, **run, "floods": floods,
                             "opened": opened})
    after = await lab.wait_idle()

    floods = attacker.results
    victim_streams = len(runs) * VICTIMS
    p99 = {c: median([r["gap_p99_s"] for r in runs if r["condition"] == c])
           for c in CONDITIONS}
    summary: dict[str, Any] = {
        **{f"gap_p99_ms_{c}": ms(p99[c]) for c in CONDITIONS},
        **{f"p99_ratio_{c}": _ratio(p99[c], p99["quiet"]) for c in ATTACKS},
        "p99_goal": P99_GOAL,
        "floods": len(floods),
        "floods_enhance_your_calm": sum(f["goaway"] == ENHANCE_YOUR_CALM for f in floods),
        "floods_per_s_reconnect": round(
            sum(len(r["floods"]) for r in runs if r["condition"] == "reconnect")
            / sum(r["duration_s"] for r in runs if r["condition"] == "reconnect"), 1),
        **{f"goaway_ms_{kind}": ms(median([f["goaway_after_s"] for f in floods
                                           if f["kind"] == kind])) for kind in BUILT},
        **{f"read_share_{kind}": _rounded(median([f["sent"] / f["total"] for f in floods
                                                  if f["kind"] == kind])) for kind in BUILT},
        "floods_madeyoureset": sum(f["kind"] == "madeyoureset" for f in floods),
        "server_resets_madeyoureset": median([f["server_resets"] for f in floods
                                              if f["kind"] == "madeyoureset"]),
        "ping_acks_max": max((f["ping_acks"] for f in floods if f["kind"] == "ping"),
                             default=None),
        "ping_burst": h2_floods.PING_BURST,
        "attacker_streams_started": _delta(after, before, "opened") - victim_streams,
        "attacker_sequences_admitted": _delta(after, before, "admitted") - victim_streams,
        **{f"attacker_streams_started_{c}": sum(r["opened"] - VICTIMS for r in runs
                                                if r["condition"] == c) for c in ATTACKS},
        "victims_complete": all(r["complete"] for r in runs),
        "units": units,
        "rounds": rounds,
    }
    raw = {"warm_up": warm_up, "runs": runs, "stats_before": before, "stats_after": after}
    return Report(summary, raw, plot=lambda fig: _draw(fig, runs))


async def _victims(url: str, prompts: list[str], tokens: int,
                   attack: Any = None) -> dict[str, Any]:
    """``VICTIMS`` streams read to their ends (``attack()`` started first, if given): their
    gaps, p99 and duration."""
    streams = [RawStream(url) for _ in prompts]
    started = trio.current_time()
    async with trio.open_nursery() as nursery:
        if attack is not None:
            await attack()
        for stream, prompt in zip(streams, prompts, strict=True):
            nursery.start_soon(_read_one, stream, prompt, tokens)
    gaps = [b - a for s in streams for a, b in zip(s.token_times, s.token_times[1:],
                                                     strict=False)]
    return {"duration_s": round(trio.current_time() - started, 3),
            "gap_p99_s": pct(gaps, 99), "gaps_s": [round(g, 5) for g in gaps],
            "complete": all(s.terminal == "done" and s.tokens == tokens for s in streams)}


async def _read_one(stream: RawStream, prompt: str, tokens: int) -> None:
    try:
        await stream.post("/v1/stream", {"prompt": prompt, "max_new_tokens": tokens,
                                         "ignore_eos": True})
        await stream.read_to_end()
    finally:
        stream.close_rst()


def _delta(after: dict[str, Any], before: dict[str, Any], key: str) -> int:
    return int(after.get(key) or 0) - int(before.get(key) or 0)


def _ratio(value: float | None, to: float | None) -> float | None:
    return None if value is None or not to else round(value / to, 2)


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _draw(fig: Any, runs: list[dict[str, Any]]) -> None:
    axis = fig.subplots()
    plot_gap_cdfs(axis, {LABELS[c]: [g for r in runs if r["condition"] == c for g in r["gaps_s"]]
                         for c in CONDITIONS}, whose="a victim's")
    axis.set_title("other clients' token gaps, quiet and beside each attacker")
