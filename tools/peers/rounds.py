"""One level, round after round: our server and the others in turn, and the ratios' spread.

::

    python -m tools.peers.rounds --llama --rounds 5 --threads 2          # one stream
    python -m tools.peers.rounds --before ../old --level 32 --rounds 3

On a shared machine a system's tokens/s moves by 5-10% from one minute to the next
(docs/results.md, "One stream on the AMD EPYC": ``llama-server`` gave 97.6 to 114.9
tokens/s at one stream in five side-by-side runs of one evening), which is as much as a
target's margin. ``tools.peers.sidebyside`` runs each system once, one after the other,
so each of its ratios compares two different minutes of the machine. This runs one
level of each system in turn (``--before``'s tree, ours, ``--llama``'s
``llama-server``: each started, warmed up and driven as the side-by-side does, then
stopped) and repeats the whole turn ``--rounds`` times: each round's ratio ours/other
compares neighbouring minutes, and the rounds give the ratio's median, least and largest
(``ratios``). At one stream, ``llama_one_stream`` says how many rounds met issue 44's
0.8x and whether the median does.

Writes ``--json`` (default ``results/rounds.json``): each round's figures per system
(the side-by-side's level figures, stream records left out), then the ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import trio

from tools.peers.sidebyside import (
    BEFORE,
    COMPARED,
    LLAMA_ONE_STREAM,
    OURS,
    _ratio,
    drive,
    thread_env,
)
from tools.server import open_server

Start = Callable[[], AbstractAsyncContextManager[str]]


def systems(args: argparse.Namespace) -> list[tuple[str, Start, str]]:
    """The systems of a round, in their order: (name, how to start it, wire protocol)."""
    env = thread_env(args.threads)
    out: list[tuple[str, Start, str]] = []
    if args.before is not None:
        out.append((BEFORE, lambda: open_server({"model": args.model}, env=env,
                                                tree=args.before, unset=args.before_unset),
                    "openai"))
    out.append((OURS, lambda: open_server({"model": args.model}, env=env), "openai"))
    if args.llama:
        from tools.peers.llama_server import LLAMA_NAME, open_llama

        out.append((LLAMA_NAME, lambda: open_llama(threads=args.threads,
                                                   parallel=args.level, env=env), "llama"))
    return out


async def run_rounds(args: argparse.Namespace) -> dict[str, Any]:
    turn = systems(args)
    rounds: list[dict[str, Any]] = []
    for number in range(1, args.rounds + 1):
        figures: dict[str, Any] = {}
        for name, start, protocol in turn:
            print(f"round {number}: {name} ...", file=sys.stderr)
            async with start() as url:
                level = await drive(url, protocol, [args.level], requests=args.requests,
                                    baseline_requests=args.requests,
                                    max_new_tokens=args.max_new_tokens,
                                    progress=not args.no_progress)
            figures[name] = {k: v for k, v in level[str(args.level)].items()
                             if k != "stream_records"}
        rounds.append(figures)
    return {"rounds": rounds, **spread(rounds, [name for name, _, _ in turn], args.level)}


def spread(rounds: list[dict[str, Any]], names: list[str], level: int) -> dict[str, Any]:
    """Each round's ratio ours/other (``COMPARED`` figures), and their median, least and
    largest; at one stream, how ``llama-server``'s ratio stands against issue 44's."""
    ratios: dict[str, Any] = {}
    for other in (name for name in names if name != OURS):
        per_round = {key: [_ratio(r[OURS].get(key), r[other].get(key)) for r in rounds]
                     for key in COMPARED}
        ratios[other] = {key: {"rounds": values, **_summary(values)}
                         for key, values in per_round.items()}
    out: dict[str, Any] = {"level": level, "ratios": ratios}
    llama = ratios.get("llama-server")
    if llama is not None and level == 1:
        values = [v for v in llama["tokens_per_s_counted"]["rounds"] if v is not None]
        median = llama["tokens_per_s_counted"]["median"]
        out["llama_one_stream"] = {
            "target": LLAMA_ONE_STREAM, "rounds_met": sum(v >= LLAMA_ONE_STREAM for v in values),
            "rounds": len(values),
            "median_met": median is not None and median >= LLAMA_ONE_STREAM}
    return out


def _summary(values: list[float | None]) -> dict[str, float | None]:
    known = [v for v in values if v is not None]
    if not known:
        return {"median": None, "least": None, "largest": None}
    return {"median": round(statistics.median(known), 3), "least": min(known),
            "largest": max(known)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.peers.rounds", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="our server's model")
    parser.add_argument("--level", type=int, default=1, help="concurrent streams")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=8,
                        help="streams a system serves per round (back to back at level 1)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch threads, every process")
    parser.add_argument("--llama", action="store_true", help="llama-server in every round")
    parser.add_argument("--before", type=Path, default=None,
                        help="another checkout whose server runs first in every round")
    parser.add_argument("--before-unset", nargs="+", default=[], metavar="VARIABLE")
    parser.add_argument("--json", type=Path, default=Path("results/rounds.json"))
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    if not args.llama and args.before is None:
        parser.error("nothing to compare with: give --llama, --before or both")
    began = time.time()
    result = trio.run(run_rounds, args)
    report = {"meta": {"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(began)),
                       "wall_s": round(time.time() - began, 1),
                       "command": "python -m tools.peers.rounds " + " ".join(
                           sys.argv[1:] if argv is None else argv),
                       "model": args.model, "level": args.level, "rounds": args.rounds,
                       "requests": args.requests, "max_new_tokens": args.max_new_tokens,
                       "threads": args.threads,
                       "before_tree": None if args.before is None else str(args.before)},
              **result}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({"ratios_tokens_per_s": {
        other: r["tokens_per_s_counted"] for other, r in result["ratios"].items()},
        "llama_one_stream": result.get("llama_one_stream")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
