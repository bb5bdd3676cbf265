"""``overlap``: what 1 to 32 simultaneous streams get from the batched engine, over HTTP.

The chapter's "Overlapping streams", with its three hypotheses:

* H1 throughput grows nearly with N while a stream's gap between tokens grows much less;
* H2 time to first token grows with the number of requests that arrive together;
* H3 a request arriving while others run waits for the step in progress and its own
  prefill, and no more.

Procedure. The 32 prompts of tools/prompts.txt, greedy, ``ignore_eos``, 64 new tokens.
A warm-up stream; then the back-to-back baseline: every prompt alone, one after another
on one connection (the baseline's time is the sum of their durations, and their tokens
are the solo reference). Then, for each repetition, for N = 1, 2, 4, 8, 16, 32: the first
N prompts sent at once from N connections released by one barrier (``tools.load``),
with the server idle before each level. Every concurrent stream's token ids are compared
with its prompt's solo run.

Joiners (H3). Twelve 8-token requests (prompts drawn with the seed) arrive at seeded
uniform random times from 0.1 s after the last of 8, then 24, long streams got its first
token (so they join decoding, not the long streams' burst of prefills); the long streams
are closed when the joiners are done. The window is the chapter's 1.5 s, or longer where
a step and a prefill are slow: ``SPACING`` (4) times (step + prefill) per joiner, with
the step taken from the level runs, so the joiners do not queue behind each other's
prefills (on a busy 2-core CPU, with 340 ms prefills, twelve joiners in 1.5 s did, and
their TTFT grew by one prefill per joiner). The joiners' TTFT is set against one step plus their
own prefill: the step is the long streams' median gap between tokens while the joiners
arrive (a client's view of a decode step at that batch size; ``/stats``'s
``median_decode_step_ms`` is recorded too, but it is a median over the engine's last 256
decode steps, most of them from earlier runs at other batch sizes), and the prefill is
the median TTFT of the same requests sent alone to the idle server.

Summary (times in ms): ``speedup_32`` (aggregate tokens/s at N=32 over back-to-back
tokens/s), ``identical_streams``/``compared_streams``, per-N medians over repetitions of
``tokens_per_s``, ``makespan_s``, ``ttft_p50``, ``ttft_p99``, ``gap_p50``, ``gap_p99``
(dicts keyed by N), ``ttft_p50_32``, ``ttft_p99_32``, ``gap_p50_32``, ``gap_p99_32``, and
``joiner_ratio_8``/``joiner_ratio_24`` (joiner TTFT p50 / (step + prefill)). With other
``--levels`` the suffixes follow the largest level. Plot: throughput, TTFT and gaps
against N.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial
from typing import Any

import trio

from tools.lab.common import (
    IDLE_TIMEOUT_S,
    Lab,
    Report,
    experiment,
    median,
    ms,
    pct,
    spread,
)
from tools.load_runner import run_streams
from tools.records import LoadResult, StreamRecord, StreamRequest

LEVELS = (1, 2, 4, 8, 16, 32)
Run = dict[str, Any]  # one level's run: its figures, identity counts and streams
JOINER_LEVELS = (8, 24)  # long streams already running when the joiners come
# Joiners come on average this many (step + prefill) apart: about what the chapter's
# 1.5 s window gave twelve joiners on its GPU (125 ms apart against 10 + 16 ms).
SPACING = 4.0


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--levels", type=int, nargs="+", help=f"default {LEVELS}")
    parser.add_argument("--repetitions", type=int, help="default 3 (quick 1)")
    parser.add_argument("--max-new-tokens", type=int, help="default 64 (quick 8)")
    parser.add_argument("--joiners", type=int, help="default 12 (quick 4)")
    parser.add_argument("--no-joiners", action="store_true", help="skip the joiner runs")


@experiment(
    "overlap",
    "throughput, TTFT and gaps of 1-32 simultaneous streams; identity with solo runs; late joiners",
    # Room for 24 long streams and the joiners at once (the default 512 blocks
    # would just hold them; with --url the server's own setting applies).
    server={"cache_blocks": 1024},
    arguments=arguments,
)
async def overlap(lab: Lab) -> Report:
    levels = sorted(lab.args.levels or LEVELS)
    repetitions = lab.option("repetitions", 3, 1)
    tokens = lab.option("max_new_tokens", 64, 8)
    prompts = lab.prompts(max(levels))
    top = levels[-1]

    await run_streams(lab.url, [StreamRequest(prompts[0], 4, True)], progress=False)
    await lab.wait_idle()
    solo = await run_streams(
        lab.url, [StreamRequest(p, tokens, True) for p in prompts], clients=1, progress=lab.progress
    )
    reference = [r.token_ids for r in solo.records]
    baseline = _baseline(solo)

    runs: list[Run] = []
    for rep in range(repetitions):
        for n in levels:
            await lab.wait_idle()
            result = await run_streams(
                lab.url,
                [StreamRequest(p, tokens, True) for p in prompts[:n]],
                progress=lab.progress,
            )
            runs.append(_level_run(rep, n, result, reference))

    by_level = {n: [r for r in runs if r["n"] == n] for n in levels}
    table = {n: _level_figures(rs) for n, rs in by_level.items()}

    def gap_ms_at(n_long: int) -> float:
        """The measured median gap at the first level with at least n_long streams."""
        level = next((n for n in levels if n >= n_long), top)
        return float(table[level]["gap_p50"] or 0.0)

    joiners: dict[int, dict[str, Any]] = {}
    if not lab.args.no_joiners:
        joiners = await _joiner_runs(lab, gap_ms_at)
    figure = {key: {n: table[n][key] for n in levels} for key in table[top]}
    summary: dict[str, Any] = {
        "model": _server_label(await lab.stats()),
        f"speedup_{top}": _ratio(
            figure["tokens_per_s"][top], baseline["back_to_back_tokens_per_s"]
        ),
        "identical_streams": sum(r["identical"] for r in runs),
        "compared_streams": sum(r["compared"] for r in runs),
        "errors": sum(r["summary"]["errors"] for r in runs)
        + sum(r.error is not None for r in solo.records)
        + sum(j["errors"] for j in joiners.values()),
        "tokens_per_s": figure["tokens_per_s"],
        f"ttft_p50_{top}": figure["ttft_p50"][top],
        f"ttft_p99_{top}": figure["ttft_p99"][top],
        f"gap_p50_{top}": figure["gap_p50"][top],
        f"gap_p99_{top}": figure["gap_p99"][top],
        **{f"joiner_ratio_{k}": j["ratio"] for k, j in joiners.items()},
        **{f"joiner_ttft_p50_{k}": j["ttft_p50"] for k, j in joiners.items()},
        # False: a long stream ended before the last joiner did, so a joiner met a
        # smaller batch than its label says (make the long streams longer).
        "joiners_overlapped": {k: j["long_streams_outlived_joiners"] for k, j in joiners.items()},
        "back_to_back_s": baseline["back_to_back_s"],
        "back_to_back_tokens_per_s": baseline["back_to_back_tokens_per_s"],
        "makespan_s": figure["makespan_s"],
        "ttft_p50": figure["ttft_p50"],
        "ttft_p99": figure["ttft_p99"],
        "gap_p50": figure["gap_p50"],
        "gap_p99": figure["gap_p99"],
        "levels": levels,
        "repetitions": repetitions,
        "max_new_tokens": tokens,
    }
    raw = {
        "baseline": baseline,
        "levels": {n: table[n] for n in levels},
        "joiners": joiners,
        "runs": runs,
        "solo": solo.to_json(),
    }
    return Report(summary, raw, plot=lambda fig: _draw(fig, levels, runs, baseline))


def _server_label(stats: dict[str, Any]) -> str:
    return f"{stats.get('model')} on {stats.get('device')}"


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a is not None and b else None


def _baseline(solo: LoadResult) -> dict[str, Any]:
    durations = [d for r in solo.records if (d := r.duration_s) is not None]
    tokens = sum(r.tokens for r in solo.records)
    total = sum(durations)
    return {
        "back_to_back_s": round(total, 3),
        "back_to_back_tokens_per_s": round(tokens / total, 2) if total else None,
        "solo_ttft_p50": ms(median([r.ttft_s for r in solo.records])),
        "solo_stream_p50_s": round(median(durations) or 0.0, 3),
        "solo_gap_p50": ms(pct([g for r in solo.records for g in r.gaps_s()], 50)),
        "last_first_token_s": _last_first_token_s(solo),
    }


def _last_first_token_s(solo: LoadResult) -> float | None:
    """When the last prompt would have seen its first token, served one after another."""
    durations = [r.duration_s or 0.0 for r in solo.records]
    last = solo.records[-1].ttft_s if solo.records else None
    return None if last is None else round(sum(durations[:-1]) + last, 3)


def _level_run(rep: int, n: int, result: LoadResult, reference: list[list[int]]) -> Run:
    compared = identical = 0
    divergences = []
    for i, record in enumerate(result.records):
        if record.error is not None:
            continue
        compared += 1
        if record.token_ids == reference[i]:
            identical += 1
        else:
            divergences.append(
                {"prompt": i, "first_divergence": _first_divergence(record.token_ids, reference[i])}
            )
    return {
        "rep": rep,
        "n": n,
        "summary": result.summary(),
        "compared": compared,
        "identical": identical,
        "divergences": divergences,
        "result": result.to_json(),
    }


def _first_divergence(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def _level_figures(runs: list[Run]) -> dict[str, Any]:
    """Medians over repetitions (and the range, for the raw table)."""
    keys = {
        "tokens_per_s": "tokens_per_s",
        "makespan_s": "makespan_s",
        "ttft_p50": "ttft_p50_ms",
        "ttft_p99": "ttft_p99_ms",
        "gap_p50": "gap_p50_ms",
        "gap_p99": "gap_p99_ms",
    }
    figures: dict[str, Any] = {}
    for name, key in keys.items():
        values = [r["summary"][key] for r in runs]
        middle = median(values)  # of an even count: a mean, with a float's tail
        figures[name] = None if middle is None else round(middle, 2)
        figures[name + "_range"] = spread(values)
    return figures


# -- joiners ----------------------------------------------------------------------------------


async def _joiner_runs(lab: Lab, gap_ms_at: Callable[[int], float]) -> dict[int, dict[str, Any]]:
    count = lab.option("joiners", 12, 4)
    joiner_tokens = lab.pick(8, 4)
    long_tokens = lab.pick(200, 120)  # outlasts the window; closed when the joiners end
    start, least = lab.pick((0.1, 1.5), (0.05, 0.25))
    all_prompts = lab.prompts()
    picks = [all_prompts[i] for i in lab.rng.sample(range(len(all_prompts)), count)]

    await lab.wait_idle()
    alone = await run_streams(
        lab.url, [StreamRequest(p, joiner_tokens, True) for p in picks], clients=1, progress=False
    )
    prefill_ms = ms(median([r.ttft_s for r in alone.records]))
    results = {}
    for n_long in JOINER_LEVELS:
        # Joiners that arrive faster than prefills finish queue behind one another, and
        # H3 is about the queue the running streams form, not that one: space them
        # (on average) SPACING times a step plus a prefill apart, or as the chapter did.
        cycle_s = (gap_ms_at(n_long) + (prefill_ms or 0.0)) / 1000
        length = max(least, SPACING * count * cycle_s)
        offsets = sorted(lab.rng.uniform(start, start + length) for _ in range(count))
        await lab.wait_idle()
        results[n_long] = await _one_joiner_run(
            lab,
            n_long,
            [
                StreamRequest(p, joiner_tokens, True, at_s=t, tag="joiner")
                for p, t in zip(picks, offsets, strict=True)
            ],
            long_tokens,
            prefill_ms,
        )
        results[n_long]["window_s"] = [start, round(start + length, 3)]
        results[n_long]["offsets_s"] = [round(t, 3) for t in offsets]
    return results


async def _one_joiner_run(
    lab: Lab,
    n_long: int,
    joiners: list[StreamRequest],
    long_tokens: int,
    prefill_ms: float | None,
) -> dict[str, Any]:
    long_specs = [StreamRequest(p, long_tokens, True, tag="long") for p in lab.prompts(n_long)]
    long_records: list[StreamRecord] = []
    all_started, stop = trio.Event(), trio.Event()

    def on_first_token(record: StreamRecord) -> None:
        long_records.append(record)
        if len(long_records) == n_long:
            all_started.set()

    async def long_streams_decoding() -> None:
        with trio.fail_after(IDLE_TIMEOUT_S):
            await all_started.wait()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            partial(
                run_streams,
                lab.url,
                long_specs,
                progress=False,
                on_first_token=on_first_token,
                stop=stop,
            )
        )
        joined = await run_streams(
            lab.url, joiners, ready=long_streams_decoding, progress=lab.progress
        )
        joiners_done = max(r.finished_at or 0.0 for r in joined.records)
        outlived = all(r.finished_at is None for r in long_records)
        stats = await lab.stats()
        stop.set()
    # The long streams' gaps while the joiners came and went: the step at this batch.
    gaps = [
        b - a
        for r in long_records
        for a, b in zip(r.token_times, r.token_times[1:], strict=False)
        if a >= joined.started_at and b <= joiners_done
    ]
    step_ms = ms(pct(gaps, 50))
    ttfts = [r.ttft_s for r in joined.records if r.ttft_s is not None]
    ttft_p50 = ms(pct(ttfts, 50))
    stats_step = stats.get("median_decode_step_ms")
    return {
        "long_streams": n_long,
        "ttft_p50": ttft_p50,
        "ttft_p99": ms(pct(ttfts, 99)),
        "step": step_ms,
        "prefill": prefill_ms,
        "ratio": _ratio(ttft_p50, (step_ms or 0) + (prefill_ms or 0)),
        "stats_median_decode_step_ms": stats_step,
        "ratio_with_stats_step": _ratio(ttft_p50, (stats_step or 0) + (prefill_ms or 0)),
        "long_streams_outlived_joiners": outlived,
        "errors": joined.summary()["errors"],
        "joiner_ttfts": [ms(t) for t in ttfts],
    }


# -- plot -------------------------------------------------------------------------------------


def _draw(fig: Any, levels: list[int], runs: list[Run], baseline: dict[str, Any]) -> None:
    throughput, ttft, gaps = fig.subplots(1, 3)
    for ax in (throughput, ttft, gaps):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(n) for n in levels])
        ax.set_xlabel("simultaneous streams N")
        ax.grid(alpha=0.3)

    def series(key: str) -> tuple[list[int], list[float]]:
        pairs = [(r["n"], r["summary"][key]) for r in runs if r["summary"][key] is not None]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    def medians(key: str) -> list[float | None]:
        return [median([r["summary"][key] for r in runs if r["n"] == n]) for n in levels]

    throughput.scatter(*series("tokens_per_s"), s=12, alpha=0.5)
    throughput.plot(levels, medians("tokens_per_s"), marker="o", label="N streams at once")
    b2b = baseline["back_to_back_tokens_per_s"]
    if b2b:
        throughput.axhline(b2b, linestyle="--", color="grey", label="back to back")
    throughput.set_ylabel("aggregate tokens/s")
    throughput.set_title("throughput")
    throughput.legend()
    for axis, name, label in (
        (ttft, "ttft", "time to first token (ms)"),
        (gaps, "gap", "gap between tokens (ms)"),
    ):
        for q in ("p50", "p99"):
            key = f"{name}_{q}_ms"
            axis.scatter(*series(key), s=12, alpha=0.5)
            axis.plot(levels, medians(key), marker="o", label=q)
        axis.set_ylabel(label)
        axis.set_title(label.split(" (")[0])
        axis.legend()
