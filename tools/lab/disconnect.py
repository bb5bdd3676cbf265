"""``disconnect``: from a client's close to the release of its cache blocks.

The chapter's "When the client goes away". A stream owns what it holds; its client's
disconnect cancels the request's scope (``app/edge/connection.py``), the stream's ``close()``
asks the engine to cancel, and the engine applies that at its next step boundary and
releases the blocks once. So the release should come within about one decode step of
the close, with at most one token made that nobody reads, and a request still waiting
for a batch slot should never be admitted. With disconnect detection switched off
(``STREAMSCOPE_LAB_DETECT_DISCONNECT=false``, a second server) nothing tells the stream,
and the sequence runs to its ``max_new_tokens``.

Procedure. The lab's server has a batch limit of 2 (``STREAMSCOPE_MAX_BATCH=2``). A probe
is a raw-socket ``/v1/stream`` request (64 tokens, greedy, ``ignore_eos``) whose client
leaves at one of three moments:

* ``waiting``: before admission. Two longer streams (32 tokens, read promptly) hold both
  batch slots first; the probe reads its start event (the stream is open), the lab waits
  until the engine's ``/stats`` counts it waiting for a slot (its snapshot is taken at
  each step), and the probe leaves.
* ``first_token``: right after its first token event, beside one holder (a stream of 32
  tokens started first and read promptly) whose token times show the step in flight.
* ``mid_stream``: after 10 token events, beside one holder.

It leaves by ``fin`` (``shutdown(SHUT_WR)``, then reading to the server's EOF) or ``rst``
(``SO_LINGER`` (1, 0) and close). The close time is the client's ``time.time()`` just
before the FIN or RST goes out; the release is ``finished_at`` from ``GET
/v1/lab/requests/<id>`` (the lab's server, ``_app.py``), the server's ``time.time()`` when
the engine's step handed out the finish, right after it released the sequence's blocks
(same machine, same clock). ``tokens_after_close`` is the request's
``completion_tokens`` minus the tokens its client read: an upper bound on the tokens
made after the close (a token may have been on its way). Six repetitions of each moment
and way of leaving, interleaved; the server is idle before each probe. Then the same on
a server with detection off.

Summary (ms unless ``_s``): ``release_ms_p50``/``release_ms_p99``/``release_ms_max``
over every probe with detection on; ``step_ms_median`` (``/stats``
``median_decode_step_ms`` after those probes: the engine's last 256 decode steps);
``release_within_one_step`` (p99 <= step + ``MARGIN_MS``), ``release_steps_p50``/``_p99``
(the release in steps); ``over_step_in_flight_ms_p99`` and
``release_within_step_in_flight``: the release against the step during which each client
left, as the clients saw it (the holders' gap spanning the close; the median where no
holder gap spans it), since the step in flight at a close is often not a median one (it
carries the probe's prefill, or two holders) and a client that leaves right after a
token leaves just as the next step begins, so its release takes that whole step (a
client may also see a holder's token of the same step just after its close, and then
take the step before for the one in flight); ``released_at_first_boundary`` (of
``probes``; per probe ``at_first_boundary``): counted in tokens where the tokens tell
(``at_first_boundary``), timed against the end of the holders' step in flight for a
waiting probe;
``waiting_admitted`` (waiting
probes that ever got a token: 0 expected; ``waiting_probes_seen_waiting`` checks that the
engine counted them waiting just before they left); ``undetected_tokens_generated`` (mean
``completion_tokens`` of the probes with detection off) and ``undetected_ran_to_max``;
``conditions``: per moment and way, p50/p99 of the release, mean and max
``tokens_after_close``, and with detection off the mean tokens generated and read.
Plot: the release time of every probe per moment beside the end of the step in flight,
and, with detection off, tokens generated against tokens read.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import trio

from tools.lab._raw import RawStream, finish_record
from tools.lab.common import Lab, Report, experiment, median, pct

MOMENTS = ("waiting", "first_token", "mid_stream")
WAYS = ("fin", "rst")
MAX_BATCH = 2
# A release within one step can still land a few ms after it: the disconnect passes
# through hypercorn's reader, the request's nursery and the hub's wake-up on a shared
# 2-core machine. Ten ms is under a tenth of a SmolLM2 step on this CPU (100-200 ms).
MARGIN_MS = 10.0
WAITING_TIMEOUT_S = 10.0
FIRST_LOOK_S = 1.0  # after the close, before asking for the finish record


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repetitions", type=int, help="default 6 (quick 1)")
    parser.add_argument("--max-new-tokens", type=int, help="the probe's; default 64 (quick 24)")
    parser.add_argument("--no-undetected", action="store_true",
                        help="skip the server with disconnect detection off")


@experiment(
    "disconnect",
    "time from a client's close (FIN or RST) to the release of its blocks, at three moments",
    server={"max_batch": MAX_BATCH},
    arguments=arguments,
)
async def disconnect(lab: Lab) -> Report:
    repetitions = lab.option("repetitions", 6, 1)
    plan = Plan(
        probe_tokens=lab.option("max_new_tokens", 64, 24),
        mid_tokens=lab.pick(10, 4),
        # Outlives the probe's visit (well under a second); with detection off a holder
        # runs to its end before the probe is admitted, so no longer than that needs.
        long_tokens=lab.pick(32, 200),
    )
    await _warm_up(lab.url)
    detected = await _probes(lab, lab.url, plan, repetitions)
    stats = await lab.stats()
    undetected: list[dict[str, Any]] = []
    if not lab.args.no_undetected:
        async with lab.server(lab_detect_disconnect=False) as url:
            await _warm_up(url)
            undetected = await _probes(lab, url, plan, repetitions)

    releases = [p["release_ms"] for p in detected]
    step = stats.get("median_decode_step_ms")
    over = [
        p["release_ms"] - (p["step_in_flight_ms"] or step)
        for p in detected
        if p["step_in_flight_ms"] is not None or step is not None
    ]
    over_p99 = pct(over, 99)
    p99 = pct(releases, 99)
    summary: dict[str, Any] = {
        "release_ms_p50": _r(pct(releases, 50)),
        "release_ms_p99": _r(p99),
        "release_ms_max": _r(max(releases, default=None)),
        "step_ms_median": _r(step),
        "release_within_one_step": (
            None if p99 is None or step is None else p99 <= step + MARGIN_MS
        ),
        "release_steps_p50": _ratio(pct(releases, 50), step),
        "release_steps_p99": _ratio(p99, step),
        # The same against the step each client actually left during (see
        # _step_in_flight_s; the /stats median where unknown): steps vary with the load.
        "over_step_in_flight_ms_p99": _r(over_p99),
        "release_within_step_in_flight": None if over_p99 is None else over_p99 <= MARGIN_MS,
        "tokens_after_close_max": max((p["tokens_after_close"] for p in detected), default=None),
        "released_at_first_boundary": sum(p["at_first_boundary"] for p in detected),
        "waiting_admitted": sum(p["admitted"] for p in detected if p["moment"] == "waiting"),
        # A check of the procedure: the engine counted the probe as waiting before it left.
        "waiting_probes_seen_waiting": sum(
            bool(p["engine_waiting_before_close"]) for p in detected if p["moment"] == "waiting"
        ),
        "undetected_tokens_generated": _r(
            sum(p["completion_tokens"] for p in undetected) / len(undetected)
            if undetected else None
        ),
        "undetected_ran_to_max": sum(
            p["completion_tokens"] == plan.probe_tokens for p in undetected
        ),
        "undetected_probes": len(undetected),
        "conditions": _conditions(detected, undetected),
        "probes": len(detected),
        "repetitions": repetitions,
        "probe_max_new_tokens": plan.probe_tokens,
        "margin_ms": MARGIN_MS,
    }
    raw = {"detected": detected, "undetected": undetected, "stats_after_detected": stats}
    return Report(summary, raw, plot=lambda fig: _draw(fig, detected, undetected, step))


@dataclass(frozen=True)
class Plan:
    """The sizes of one run's requests."""

    probe_tokens: int  # the probe's max_new_tokens
    mid_tokens: int  # tokens read before leaving mid-stream
    long_tokens: int  # the slot holders' max_new_tokens


async def _warm_up(url: str) -> None:
    warm = RawStream(url)
    await warm.post("/v1/stream", {"prompt": "Hello", "max_new_tokens": 2})
    await warm.read_to_end()
    warm.close_rst()


async def _probes(lab: Lab, url: str, plan: Plan, repetitions: int) -> list[dict[str, Any]]:
    probes: list[dict[str, Any]] = []
    prompts = lab.prompts()
    for rep in range(repetitions):
        for moment in MOMENTS:
            for way in WAYS:
                await lab.wait_idle(url)
                prompt = prompts[len(probes) % len(prompts)]
                probe = await _one_probe(lab, url, plan, prompt, moment, way)
                probes.append({"rep": rep, **probe})
    await lab.wait_idle(url)
    return probes


async def _one_probe(
    lab: Lab, url: str, plan: Plan, prompt: str, moment: str, way: str
) -> dict[str, Any]:
    """One client leaving at ``moment`` by ``way``; when its blocks went back."""
    holders: list[RawStream] = []
    try:
        # Waiting: holders fill every slot. Otherwise one holder shares the batch with
        # the probe, so that its token times show the step during which the probe left.
        for i in range(MAX_BATCH if moment == "waiting" else 1):
            holder = RawStream(url)
            holders.append(holder)
            await holder.post("/v1/stream", {"prompt": lab.prompts()[i], "ignore_eos": True,
                                             "max_new_tokens": plan.long_tokens})
            await holder.read_until(lambda c: c.tokens >= 1)  # admitted: holds a slot
        async with trio.open_nursery() as nursery:
            for holder in holders:  # read promptly: the holders must not be slow readers
                nursery.start_soon(holder.read_to_end)
            probe = RawStream(url)
            await probe.post("/v1/stream", {"prompt": prompt, "ignore_eos": True,
                                            "max_new_tokens": plan.probe_tokens})
            wanted = {"waiting": 0, "first_token": 1, "mid_stream": plan.mid_tokens}[moment]
            await probe.read_until(lambda c: c.request_id is not None and c.tokens >= wanted)
            waiting_before = await _engine_waiting(lab, url) if moment == "waiting" else None
            await probe.close(way)
            async with lab.client(url) as http:
                # Asking at once would load the server (and this client) during the very
                # step being measured; a release comes within about a step.
                await trio.sleep(FIRST_LOOK_S)
                record = await finish_record(http, probe.request_id or "", timeout_s=180.0)
            nursery.cancel_scope.cancel(reason="the probe is measured")
    finally:
        for holder in holders:
            holder.close_rst()
    assert probe.closed_wall is not None
    length_s, to_end_s = _step_in_flight_s(probe, holders)
    row = {
        "moment": moment,
        "way": way,
        "request_id": probe.request_id,
        "release_ms": round((record["finished_at"] - probe.closed_wall) * 1000, 2),
        "finish_reason": record["finish_reason"],
        "completion_tokens": record["completion_tokens"],
        "tokens_read": probe.tokens,
        "tokens_after_close": record["completion_tokens"] - probe.tokens,
        "admitted": record["completion_tokens"] > 0,
        "engine_waiting_before_close": waiting_before,
        "client_gap_ms_median": _r(
            None if not probe.gaps_s() else 1000 * (median(probe.gaps_s()) or 0.0)
        ),
        "step_in_flight_ms": _r(_ms(length_s)),
        "step_in_flight_end_ms": _r(_ms(to_end_s)),
    }
    return {**row, "at_first_boundary": at_first_boundary(row)}


def at_first_boundary(probe: dict[str, Any]) -> bool:
    """Whether a probe's sequence was released at the first step boundary after its close.

    Counted in tokens where the tokens tell: the hub sends a first token mid-step, as soon
    as its prefill is done, so a client leaving after it leaves during that step, and any
    token made after its close means a later step ran; a later token is sent at the end
    of its step, and the step after it may already be running when the client leaves, so
    one token after the close is that step. A waiting probe makes no tokens: its release
    must come by the end of its holders' step in flight, as they saw it, plus the margin.
    """
    if probe["moment"] == "first_token":
        return bool(probe["tokens_after_close"] == 0)
    if probe["moment"] == "mid_stream":
        return bool(probe["tokens_after_close"] <= 1)
    end = probe["step_in_flight_end_ms"]
    return end is not None and probe["release_ms"] <= end + MARGIN_MS


def _step_in_flight_s(
    probe: RawStream, holders: list[RawStream]
) -> tuple[float | None, float | None]:
    """The engine step during which the client left, as a holder saw it: its length, and
    the time from the close to its end; (None, None) where no holder gap spans the close.

    Tokens leave at the end of a step, so the gap between consecutive tokens of a stream
    is one step; the holders are in that step. Of several holders, the one whose token
    came first after the close."""
    closed = probe.closed_at
    spans = [
        (b, b - a)
        for holder in holders
        for a, b in zip(holder.token_times, holder.token_times[1:], strict=False)
        if closed is not None and a <= closed < b
    ]
    if not spans or closed is None:
        return None, None
    end, length = min(spans)
    return length, end - closed


async def _engine_waiting(lab: Lab, url: str) -> int:
    """Wait (up to ``WAITING_TIMEOUT_S``) until the engine counts a request waiting for a
    slot, and return its count. Its statistics are a snapshot taken at each step, so the
    probe shows up one step after it was submitted; leaving before that would also test
    a cancel that overtakes the submission in the engine's inbox, another moment."""
    waiting = 0
    async with lab.client(url) as client:
        with trio.move_on_after(WAITING_TIMEOUT_S):
            while not waiting:
                waiting = (await lab.stats(client=client))["waiting"] or 0
                if not waiting:
                    await trio.sleep(0.01)
    return waiting


def _conditions(
    detected: list[dict[str, Any]], undetected: list[dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    table: dict[str, dict[str, Any]] = {}
    for moment in MOMENTS:
        for way in WAYS:
            on = [p for p in detected if (p["moment"], p["way"]) == (moment, way)]
            off = [p for p in undetected if (p["moment"], p["way"]) == (moment, way)]
            after = [p["tokens_after_close"] for p in on]
            row: dict[str, Any] = {
                "release_ms_p50": _r(pct([p["release_ms"] for p in on], 50)),
                "release_ms_p99": _r(pct([p["release_ms"] for p in on], 99)),
                "tokens_after_close_mean": _r(sum(after) / len(after) if after else None),
                "tokens_after_close_max": max(after, default=None),
            }
            if moment == "waiting":
                row["admitted"] = sum(p["admitted"] for p in on)
            if off:
                row["undetected_generated_mean"] = _r(
                    sum(p["completion_tokens"] for p in off) / len(off))
                row["undetected_read_mean"] = _r(sum(p["tokens_read"] for p in off) / len(off))
                row["undetected_release_s_p50"] = _r(
                    (pct([p["release_ms"] for p in off], 50) or 0) / 1000, 3)
            table[f"{moment}_{way}"] = row
    return table


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 2)


def _r(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


def _draw(fig: Any, detected: list[dict[str, Any]], undetected: list[dict[str, Any]],
          step: float | None) -> None:
    release, waste = fig.subplots(1, 2)
    names = [f"{m}\n{w}" for m in MOMENTS for w in WAYS]
    for i, (moment, way) in enumerate((m, w) for m in MOMENTS for w in WAYS):
        mine = [p for p in detected if (p["moment"], p["way"]) == (moment, way)]
        release.scatter([i - 0.1] * len(mine), [p["release_ms"] for p in mine], s=18,
                        alpha=0.7, color="tab:blue", label="release" if i == 0 else None)
        ends = [p["step_in_flight_end_ms"] for p in mine if p["step_in_flight_end_ms"] is not None]
        release.scatter([i + 0.1] * len(ends), ends, s=24, marker="_", color="tab:orange",
                        label="end of the step in flight, as a holder saw it" if i == 0 else None)
    if step is not None:
        release.axhline(step, color="grey", linestyle="--",
                        label=f"median decode step {step:.1f} ms")
    release.legend()
    release.set_xticks(range(len(names)), names)
    release.set_ylabel("close to release of the blocks (ms)")
    release.set_title("disconnect detected: release time per moment")
    release.grid(axis="y", alpha=0.3)
    if undetected:
        for moment, marker in zip(MOMENTS, "os^", strict=True):
            mine = [p for p in undetected if p["moment"] == moment]
            waste.scatter([p["tokens_read"] for p in mine],
                          [p["completion_tokens"] for p in mine], marker=marker, label=moment)
        waste.set_xlabel("tokens the client read before leaving")
        waste.set_ylabel("tokens the engine generated")
        waste.set_title("disconnect not detected: the sequence runs on")
        waste.legend()
        waste.grid(alpha=0.3)
