"""What tracing and request logs cost: tokens/s and server CPU per token, on against off.

::

    nice -n 15 python -m tools.tracebench --json results/tracebench.json

Measured as ``tools.scopebench`` measures the scope (docs/results.md, issue 38), with one
difference the setting forces: tracing is chosen at startup, so there are two servers
(``tools.server.open_server``: ``app:app`` under hypercorn, the embedded model by
default), both started and warmed before any run: *off* with the defaults (no endpoint,
text logs: no record is made), *on* with ``STREAMSCOPE_OTLP_ENDPOINT`` pointing at a
real OTLP/HTTP receiver in this process (``tests/otlp_receiver.py``, which decodes every
export, as a collector does) and ``STREAMSCOPE_LOG_FORMAT=json`` (a JSON line per
request into the server's log file). Then ``--rounds`` rounds of two runs in alternating
order (off, on; on, off; ...), only one server loaded at a time: ``--streams``
concurrent streams (``tools.load``, the native route, ``--max-new-tokens`` greedy
tokens, end of sequence off). Per run: the load summary and the serving process's CPU
seconds (``/proc`` utime + stime, all its threads: the span processor's export thread
too) per token. ``ratio`` is on / off of the median tokens/s, ``cpu_ratio`` on / off of
the median CPU per token (the figure to read on a shared machine, where the wall clock
moves with everyone's load); issue 47's goal: metrics, traces and logs cost at most 2%
(``ratio`` >= 0.98; ``cpu_ratio`` <= 1.02). ``spans`` counts what the receiver got: four
per request of the *on* runs (the request's span and its three children), or tracing
was not on.

``record_cost`` (or ``--record-cost-only``): the direct cost, without a server, in this
process: CPU microseconds a request spends in the per-request record, its span (made,
ended, batched, encoded and posted by the exporter's thread to the receiver, all counted
by ``time.process_time``) and its JSON line (to /dev/null), for a request of
``--max-new-tokens`` tokens through the real ``RequestTimer``, minus the same requests
with no record. Divided by the tokens, and by the *off* server's CPU per token, it
bounds what tracing adds to each token (``share_of_server_cpu_per_token``); with the
metrics timer's own cost, what all three cost (``all_share_of_server_cpu_per_token``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import trio

from app.metrics import Metrics
from app.request_log import LOGGER, JsonFormatter, RequestLog
from app.request_record import Recorder
from app.tracing import Tracing
from engine import FinishEvent, FinishReason, TokenEvent
from tests.otlp_receiver import OtlpReceiver
from tools.load_runner import run_load
from tools.prompts import load_prompts
from tools.scopebench import cpu_s, serving_pid
from tools.server import open_server

GOAL = 0.98  # tokens/s with tracing and logs over without, at least (issue 47)
SPANS_PER_REQUEST = 4  # the request's and its three children
WARM_UP = 2  # short streams each server serves before the runs (their spans count too)
BATCH = 200  # requests between flushes in record_cost: 800 spans, under the 2048 queue


async def one_run(url: str, pid: int, prompts: list[str], args: argparse.Namespace,
                  kind: str) -> dict[str, Any]:
    """One load run against one server: its summary and that server's CPU per token."""
    before = cpu_s(pid)
    result = await run_load(url, prompts, clients=args.streams,
                            max_new_tokens=args.max_new_tokens, ignore_eos=True,
                            progress=False)
    row: dict[str, Any] = {"kind": kind, **result.summary()}
    row["server_cpu_s"] = round(cpu_s(pid) - before, 2)
    row["server_cpu_ms_per_token"] = round(row["server_cpu_s"] * 1000 / row["tokens"], 3) \
        if row["tokens"] else None
    return row


async def run(args: argparse.Namespace, receiver: OtlpReceiver) -> dict[str, Any]:
    prompts = load_prompts()
    base = {"model": args.model, "max_batch": max(args.streams, 1)}
    env = {"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    kinds = {"off": base, "on": {**base, "otlp_endpoint": receiver.url, "log_format": "json",
                                 "replica": "tracebench"}}
    began = time.time()
    async with AsyncExitStack() as stack:
        urls = {kind: await stack.enter_async_context(open_server(settings, env=env))
                for kind, settings in kinds.items()}
        pids = {kind: serving_pid(url) for kind, url in urls.items()}
        for url in urls.values():
            await run_load(url, prompts, clients=WARM_UP, max_new_tokens=8, progress=False)
        runs = []
        for n in range(args.rounds):
            for kind in ("off", "on") if n % 2 == 0 else ("on", "off"):
                runs.append(await one_run(urls[kind], pids[kind], prompts, args, kind))
                print(json.dumps(runs[-1]), file=sys.stderr)
    # The servers have stopped: the on server's provider flushed its last spans.
    return summarize(runs, args, began, len(receiver.spans()))


def summarize(runs: list[dict[str, Any]], args: argparse.Namespace, began: float,
              spans: int) -> dict[str, Any]:
    def median(kind: str, key: str) -> float:
        return statistics.median(r[key] for r in runs if r["kind"] == kind)

    off, on = median("off", "tokens_per_s"), median("on", "tokens_per_s")
    cpu_off = round(median("off", "server_cpu_ms_per_token"), 3)
    cpu_on = round(median("on", "server_cpu_ms_per_token"), 3)
    ratio = round(on / off, 4)
    on_requests = WARM_UP + sum(r["streams"] for r in runs if r["kind"] == "on")
    return {
        "model": args.model, "streams": args.streams, "max_new_tokens": args.max_new_tokens,
        "rounds": args.rounds, "threads": args.threads,
        "seconds": round(time.time() - began, 1),
        "off_tokens_per_s": round(off, 2), "on_tokens_per_s": round(on, 2),
        "ratio": ratio, "goal": GOAL, "within_goal": ratio >= GOAL,
        "off_server_cpu_ms_per_token": cpu_off, "on_server_cpu_ms_per_token": cpu_on,
        "cpu_ratio": round(cpu_on / cpu_off, 4),
        "spans": spans, "spans_expected": on_requests * SPANS_PER_REQUEST,
        "load_average": os.getloadavg(),
        "errors": sum(r["errors"] for r in runs),
        "runs": runs,
    }


def record_cost(tokens: int, requests: int = 1000) -> dict[str, Any]:
    """CPU microseconds per request and per token that the record, span and JSON line
    add to a request of ``tokens`` tokens (``RequestTimer`` with a record, minus without).
    The receiver runs in a process of its own: its decoding is not counted here."""
    receiver = subprocess.Popen([sys.executable, "-m", "tests.otlp_receiver"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                cwd=Path(__file__).resolve().parent.parent)
    assert receiver.stdin is not None and receiver.stdout is not None
    url = receiver.stdout.readline().strip()
    logger = logging.getLogger(LOGGER)
    sink = logging.FileHandler(os.devnull)
    sink.setFormatter(JsonFormatter())
    logger.addHandler(sink)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    tracing = Tracing(url, "tracebench")
    recorder = Recorder(model="bench", replica="tracebench", tracing=tracing, log=RequestLog(),
                        key_name=lambda: None)
    stats: dict[str, Any] = {}
    try:
        plain = _timed(Metrics(dict), tokens, requests, flush=None)
        traced = _timed(Metrics(dict, recorder=recorder), tokens, requests,
                        flush=tracing.provider.force_flush)
    finally:
        tracing.shutdown()
        logger.removeHandler(sink)
        sink.close()
        received, _ = receiver.communicate("", timeout=60)
    extra_us = (traced - plain) / requests * 1e6
    stats.update(requests=requests, tokens_per_request=tokens,
                 plain_cpu_us_per_request=round(plain / requests * 1e6, 1),
                 traced_cpu_us_per_request=round(traced / requests * 1e6, 1),
                 extra_cpu_us_per_request=round(extra_us, 1),
                 extra_cpu_us_per_token=round(extra_us / tokens, 2),
                 spans_received=int(received.split()[-1]))
    return stats


def _timed(metrics: Metrics, tokens: int, requests: int, flush: Any) -> float:
    """CPU seconds (all threads) for ``requests`` requests through a timer."""
    started = time.process_time()
    for n in range(requests):
        timer = metrics.start_request()
        timer.submitted(20, f"bench-{n}", tokens)
        for i in range(tokens):
            timer.observe(TokenEvent(f"bench-{n}", i, 1, "x"))
        timer.observe(FinishEvent(f"bench-{n}", FinishReason.LENGTH, 20, tokens))
        timer.close()
        if flush is not None and (n + 1) % BATCH == 0:
            flush()
    if flush is not None:
        flush()
    return time.process_time() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="pairs of runs")
    parser.add_argument("--threads", type=int, default=2, help="torch's intra-op threads")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    parser.add_argument("--record-cost-only", action="store_true",
                        help="measure the per-request record's cost alone, without servers")
    args = parser.parse_args(argv)
    with OtlpReceiver().running() as receiver:
        data: dict[str, Any] = {} if args.record_cost_only else trio.run(run, args, receiver)
    data["record_cost"] = cost = record_cost(args.max_new_tokens)
    if data.get("off_server_cpu_ms_per_token"):
        per_token_ms = data["off_server_cpu_ms_per_token"]
        cost["share_of_server_cpu_per_token"] = round(
            cost["extra_cpu_us_per_token"] / 1000 / per_token_ms, 5)
        # The metrics' timer too (the plain requests): the goal's "metrics, traces and logs".
        cost["all_share_of_server_cpu_per_token"] = round(
            cost["traced_cpu_us_per_request"] / cost["tokens_per_request"] / 1000
            / per_token_ms, 5)
    text = json.dumps(data, indent=2)
    print(text)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    return 0 if data.get("errors", 0) == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
