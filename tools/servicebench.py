"""The serving path's capacity: tokens/s delivered over HTTP against the engine's ceiling.

::

    python -m tools.servicebench [--json results/servicebench.json] [--plot FILE.png]
    python -m tools.servicebench --quick          # levels 1 and 8, 32 tokens: seconds

Why: the engine's step is measured alone elsewhere (``python -m tools.bench step``); what the
serving path (hub, policies, SSE, hypercorn, the event loop) costs a token, and how much
of the engine's rate reaches clients, is measured only here, against a ceiling taken in
the same run, and beside another serving path over the same engine.

For each engine of ``--engines`` (both by default):

* ``tiny``: the tiny GPT-2 (``STREAMSCOPE_MODEL=tiny-gpt2``). Its ceiling is the engine
  alone in this process on the same model: N sequences submitted, stepped to the end,
  and tokens/s = N / the mean step time over the steps in which all N decode (after
  every prefill, before the first finish), one torch thread, as ``tools.bench step``'s
  ``engine_stepper`` times a step.
* ``simulated``: ``tools/simulated.py``'s runner, a forward pass of ``--sim-step-ms``
  whatever the batch, everything else the real engine. Its ceiling is N / step_ms; the
  engine alone in process (measured as above) says what the engine's bookkeeping adds.

At each level N of ``--levels`` (STREAMSCOPE_MAX_BATCH and STREAMSCOPE_MAX_WAITING the
largest level), two servers run side by side, started at once and idle while the other
is measured: ours (``hypercorn -k trio app:app``, or ``'tools.simulated:build_app()'``)
and the peer (``tools/peers/uvicorn_starlette.py``: the same engine behind uvicorn and Starlette's
``StreamingResponse``, h11 and the asyncio loop as on ours), both with ``--backlog``
2048 (``app/edge/serve.py``'s LISTEN_BACKLOG: hypercorn's 100 drops part of a burst of
connections) and ``OMP_NUM_THREADS=1``. Inherited ``STREAMSCOPE_`` variables are
dropped: the command defines the configuration. Each server is warmed up with two short
streams first. The client is ``tools/servicebench_client.py``, a process of its own: N
``POST /v1/stream`` at once, one connection each, ``--tokens`` tokens, EOS off, greedy,
prompts the first ``--prompt-words`` words of ``tools/prompts.txt``'s lines. A level is
``--repeats`` rounds (default 2) of the ceiling and then both servers, ours first in
even rounds and the peer first in odd ones; for each the fastest round is kept whole (on
a machine shared with other work, the least disturbed), and every round's tokens/s is
kept beside it (``tries_tokens_per_s``).

How each figure is measured (per engine, level and server):

* ``tokens_per_s``: tokens counted by the client (``event: token`` occurrences) over its
  makespan, first connect to last EOF; ``share_of_ceiling``: that over the ceiling.
* CPU per token: the serving process (hypercorn's worker; uvicorn's only process) read
  from ``/proc/<pid>/task/<tid>/schedstat`` (ns on CPU; ``stat``'s utime + stime where
  absent) just before the client is told to go and just after it reports, over tokens
  delivered. ``loop``: the main thread (tid == pid), where the event loop runs; ``step``:
  the other thread with the most CPU in the window (its name is ``step_thread``: Trio's
  worker thread on ours, which may also have run a prompt's tokenization, or the
  peer's ``engine-step``); ``other``: every other thread; ``process``: the whole process
  (``/proc/<pid>/stat``, 10 ms ticks).
* ``step_wait_share``: the share of the window the stepping thread spent waiting for the
  loop, from ``/stats``: its ``loop_wait_s`` difference over the window where our hub
  reports it; else ``step_idle_share``. ``step_idle_share``: 1 - (engine steps in the
  window x ``median_decode_step_ms``, both from ``/stats``) / window, the share in which
  the engine was not inside ``step()``: waiting for the loop, or for work (a median:
  steps slowed by waits for the GIL count at the median's length, so this is an upper
  bound when step times spread). ``step_running_share``: the stepping thread's CPU in
  the window (plus, for the simulated runner, engine steps x ``--sim-step-ms``, its
  passes' sleep; the pass's own few CPU microseconds are then counted twice) over the
  window: what is left is time off the CPU, waiting for the GIL, the loop or work, or
  for a CPU: ``loop_queued_share`` and ``step_queued_share`` are the threads' run-queue
  time (``schedstat``'s second field: runnable, every CPU taken, by the other thread or
  by other work on the machine) over the window.
* TTFT: request written to its first token, per stream; gaps: between consecutive token
  arrivals of a stream (tokens read together arrive together: a gap of 0), pooled over
  the streams; p50, p99 (linear between ranks) and max.
* ``bytes_per_token``: every byte received (HTTP heads, chunk framing, start and done
  events included) over tokens. ``rss_mib`` / ``rss_peak_mib``: the serving process's
  VmRSS and VmHWM after the level. ``client_cpu_s``: the client's ``process_time`` over
  its makespan (``client_cpu_share``: over the makespan; near 1 would mean the client
  limits the figure).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tools.prompts import load_prompts
from tools.server import REPO_ROOT, ServerError
from tools.servicebench_ceiling import measure_ceiling
from tools.servicebench_chart import draw, table
from tools.servicebench_client import STALL_S
from tools.servicebench_proc import Snapshot, cpu_figures, memory_mib, snapshot, wait_figures
from tools.servicebench_servers import (
    APPS,
    BACKLOG,
    OURS,
    PEER,
    TINY_MODEL,
    Server,
    running_servers,
)

LEVELS = (1, 32, 128, 256)
TOKENS = 256
QUICK_LEVELS = (1, 8)
QUICK_TOKENS = 32
REPEATS = 2
ENGINES = ("tiny", "simulated")
PROMPT_WORDS = 4  # short prompts: a level is decode, not prefill
WARMUP_STREAMS, WARMUP_TOKENS = 2, 4
ROW_FIELDS = (
    "streams", "streams_complete", "tokens", "tokens_expected", "tokens_per_s",
    "share_of_ceiling", "makespan_s", "window_s", "loop_cpu_us_per_token",
    "step_cpu_us_per_token", "other_cpu_us_per_token", "process_cpu_us_per_token",
    "step_thread", "step_cpu_s", "step_wait_share", "step_wait_method", "step_idle_share",
    "step_running_share", "loop_queued_share", "step_queued_share", "engine_steps",
    "median_decode_step_ms", "ttft_p50_ms", "ttft_p99_ms", "ttft_max_ms", "gap_p50_ms",
    "gap_p99_ms", "gap_max_ms", "bytes_per_token", "rss_mib", "rss_peak_mib",
    "client_cpu_s", "client_cpu_share", "statuses", "errors", "tries_tokens_per_s",
)


# -- one level ---------------------------------------------------------------------------


def request_bodies(n: int, tokens: int, words: int) -> list[dict[str, Any]]:
    prompts = load_prompts()
    return [{"prompt": " ".join(prompts[i % len(prompts)].split()[:words]),
             "max_new_tokens": tokens, "ignore_eos": True} for i in range(n)]


def drive(server: Server, bodies: list[dict[str, Any]], stall_s: float
          ) -> tuple[dict[str, Any], Snapshot, Snapshot]:
    """Run the client against ``server``; its summary and the server's snapshots."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as file:
        json.dump(bodies, file)
    client = subprocess.Popen(
        [sys.executable, "-m", "tools.servicebench_client", "--url", server.url,
         "--bodies", file.name, "--stall-s", str(stall_s)],
        cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert client.stdin is not None and client.stdout is not None
        if client.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the client did not start (exit {client.wait()})")
        start = snapshot(server.url, server.pid, stats_first=True)
        client.stdin.write("go\n")
        client.stdin.flush()
        line = client.stdout.readline()
        end = snapshot(server.url, server.pid, stats_first=False)
        client.wait()
        if not line:
            raise RuntimeError(f"the client ended without a result (exit {client.returncode})")
        result: dict[str, Any] = json.loads(line)
        return result, start, end
    finally:
        if client.poll() is None:  # we are leaving on an error
            client.kill()
            client.wait()
        os.unlink(file.name)


def level_row(server: Server, n: int, tokens: int, words: int, stall_s: float,
              pass_ms: float = 0.0) -> dict[str, Any]:
    """Every figure of ``ROW_FIELDS`` but the share of the ceiling, for one level;
    ``pass_ms``: the wall time of a forward pass spent off the CPU (the simulated
    runner's sleep), counted as the stepping thread's running time."""
    result, start, end = drive(server, request_bodies(n, tokens, words), stall_s)
    delivered = result["tokens"]
    makespan = result["makespan_s"]
    rss, peak = memory_mib(server.pid)
    row: dict[str, Any] = {
        "streams": n, "streams_complete": sum(s["complete"] and s["tokens"] == tokens
                                              for s in result["streams"]),
        "tokens": delivered, "tokens_expected": n * tokens,
        "tokens_per_s": round(delivered / makespan, 1), "makespan_s": round(makespan, 3),
        "window_s": round(end.at - start.at, 3),
        **cpu_figures(start, end, server.pid, delivered), **wait_figures(start, end),
        "bytes_per_token": round(result["bytes"] / max(delivered, 1), 1),
        "rss_mib": round(rss, 1), "rss_peak_mib": round(peak, 1),
        "client_cpu_s": round(result["cpu_s"], 3),
        "client_cpu_share": round(result["cpu_s"] / makespan, 3),
        "statuses": sorted({str(s["status"]) for s in result["streams"]}),
        "errors": sorted({s["error"] for s in result["streams"] if s["error"]}),
    }
    for kind in ("ttft", "gap"):
        for key, value in result[f"{kind}_ms"].items():
            row[f"{kind}_{key}_ms"] = None if value is None else round(value, 2)
    running_s = row["step_cpu_s"] + row["engine_steps"] * pass_ms / 1000
    row["step_running_share"] = round(running_s / (end.at - start.at), 4)
    if delivered != n * tokens:
        print(f"{server.name}: {delivered} of {n * tokens} tokens ({row['errors']}); its "
              f"log ends:\n{server.process.tail(3000)}", file=sys.stderr)
    return row


# -- the run ------------------------------------------------------------------------------


def run_engine(kind: str, args: argparse.Namespace, loaded: Any) -> dict[str, Any]:
    """Every level of one engine, both servers running (see ``measure_level``)."""
    with running_servers(kind, max(args.levels), args.sim_step_ms) as servers:
        warm = request_bodies(WARMUP_STREAMS, WARMUP_TOKENS, args.prompt_words)
        for server in servers:
            drive(server, warm, args.client_stall_s)
        levels = {str(n): measure_level(kind, n, servers, args, loaded) for n in args.levels}
    return {"app": APPS[kind], "levels": levels}


def measure_level(kind: str, n: int, servers: list[Server], args: argparse.Namespace,
                  loaded: Any) -> dict[str, Any]:
    """``--repeats`` rounds of: the ceiling, then both servers (ours first in even
    rounds, the peer first in odd ones). The fastest round of each is kept (on a shared
    machine, the one least disturbed); every round's tokens/s is in ``tries_tokens_per_s``."""
    bodies = request_bodies(n, args.tokens, args.prompt_words)
    pass_ms = args.sim_step_ms if kind == "simulated" else 0.0
    ceilings: list[dict[str, Any]] = []
    tries: dict[str, list[dict[str, Any]]] = {server.name: [] for server in servers}
    for repeat in range(args.repeats):
        ceilings.append(measure_ceiling(kind, loaded, bodies, args.sim_step_ms))
        for server in servers if repeat % 2 == 0 else servers[::-1]:
            row = level_row(server, n, args.tokens, args.prompt_words, args.client_stall_s,
                            pass_ms)
            tries[server.name].append(row)
            print(f"  {kind} N={n} {server.name}: {row['tokens_per_s']} tokens/s",
                  file=sys.stderr)
    ceiling = max(ceilings, key=lambda c: c["engine_alone"]["tokens_per_s"])
    ceiling["tries_tokens_per_s"] = [c["engine_alone"]["tokens_per_s"] for c in ceilings]
    rows = {}
    for name, rounds in tries.items():
        row = max(rounds, key=lambda r: r["tokens_per_s"])
        row["tries_tokens_per_s"] = [r["tokens_per_s"] for r in rounds]
        row["share_of_ceiling"] = round(row["tokens_per_s"] / ceiling["tokens_per_s"], 4)
        if kind == "simulated":
            row["share_of_engine_alone"] = round(
                row["tokens_per_s"] / ceiling["engine_alone"]["tokens_per_s"], 4)
        rows[name] = row
    ratio = rows[OURS]["tokens_per_s"] / max(rows[PEER]["tokens_per_s"], 1e-9)
    return {"ceiling": ceiling, "systems": rows, "ours_over_peer": round(ratio, 3)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from engine.model import load_model

    torch.set_num_threads(1)
    began, load_before = time.time(), os.getloadavg()
    loaded = load_model(TINY_MODEL, "cpu")
    engines = {kind: run_engine(kind, args, loaded) for kind in args.engines}
    return {"meta": meta(args, began, load_before), "engines": engines}


def meta(args: argparse.Namespace, began: float, load_before: tuple[float, ...]
         ) -> dict[str, Any]:
    return {
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(began)),
        "wall_s": round(time.time() - began, 1),
        "command": "python -m tools.servicebench " + " ".join(args.argv),
        "levels": args.levels, "tokens": args.tokens, "engines": args.engines,
        "repeats": args.repeats,
        "sim_step_ms": args.sim_step_ms, "prompt_words": args.prompt_words,
        "model": TINY_MODEL, "torch_threads": 1, "eos": "off (ignore_eos)", "greedy": True,
        "servers": {OURS: "hypercorn -k trio (h11)", PEER: "uvicorn + Starlette "
                    "StreamingResponse (--loop asyncio --http h11)"},
        "max_batch": max(args.levels), "backlog": BACKLOG, "cpus": os.cpu_count(),
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "methods": {
            "tokens_per_s": "client-counted 'event: token' / client makespan",
            "cpu_per_token": "/proc/<pid>/task/<tid>/schedstat (else stat) over the client's "
                             "window / tokens; loop = tid pid, step = busiest other thread",
            "step_wait_share": "/stats loop_wait_s difference / window where reported, "
                               "else step_idle_share",
            "step_idle_share": "1 - /stats (steps difference x median_decode_step_ms) / window",
            "step_running_share": "(step thread CPU + engine steps x sim_step_ms for the "
                                  "simulated runner) / window",
            "queued_share": "schedstat run-queue time (runnable, no CPU free) / window",
            "ttft": "request written to first token, per stream",
            "gaps": "consecutive token arrivals of a stream, pooled; same read = 0",
            "bytes_per_token": "all bytes received / tokens",
            "rss": "serving process VmRSS / VmHWM after the level",
        },
    }


# -- the command -------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tools.servicebench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", type=int, nargs="+", default=None,
                        help=f"concurrent streams (default {' '.join(map(str, LEVELS))})")
    parser.add_argument("--tokens", type=int, default=None,
                        help=f"tokens a stream (default {TOKENS})")
    parser.add_argument("--engines", default=",".join(ENGINES),
                        help="comma-separated: tiny, simulated")
    parser.add_argument("--sim-step-ms", type=float, default=None,
                        help="the simulated forward pass (default tools.simulated's)")
    parser.add_argument("--prompt-words", type=int, default=PROMPT_WORDS)
    parser.add_argument("--repeats", type=int, default=None,
                        help=f"rounds per level, the fastest kept (default {REPEATS}; "
                             "quick 1)")
    parser.add_argument("--client-stall-s", type=float, default=None,
                        help="the client gives up after this long without a byte "
                             "(default tools.servicebench_client's)")
    parser.add_argument("--quick", action="store_true",
                        help=f"levels {QUICK_LEVELS}, {QUICK_TOKENS} tokens (the test's form)")
    parser.add_argument("--json", type=Path, default=Path("results/servicebench.json"))
    parser.add_argument("--plot", type=Path, default=None,
                        help="PNG (default: the JSON's path with .png)")
    args = parser.parse_args(argv)
    from tools.simulated import DEFAULT_STEP_MS

    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.levels = sorted(set(args.levels or (QUICK_LEVELS if args.quick else LEVELS)))
    args.tokens = args.tokens or (QUICK_TOKENS if args.quick else TOKENS)
    args.repeats = max(1, args.repeats or (1 if args.quick else REPEATS))
    args.sim_step_ms = args.sim_step_ms or DEFAULT_STEP_MS
    args.client_stall_s = args.client_stall_s or STALL_S
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = set(args.engines) - set(ENGINES)
    if unknown or not args.engines:
        parser.error(f"--engines: {', '.join(sorted(unknown)) or 'none'}; known: "
                     f"{', '.join(ENGINES)}")
    args.plot = args.plot or args.json.with_suffix(".png")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        data = run(args)
    except ServerError as exc:
        print(exc, file=sys.stderr)
        return 1
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(data, indent=1))
    draw(data, args.plot)
    print(table(data))
    complete = all(row["tokens"] == row["tokens_expected"]
                   for result in data["engines"].values()
                   for level in result["levels"].values() for row in level["systems"].values())
    return 0 if complete else 1


if __name__ == "__main__":
    raise SystemExit(main())
