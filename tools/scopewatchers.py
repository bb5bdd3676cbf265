"""What many ``/scope/events`` watchers cost another client's stream, end to end.

::

    nice -n 15 python -m tools.scopewatchers --watchers 0,64,400 --json out.json
    nice -n 15 python -m tools.scopewatchers --watchers 0,400 --tree /other/checkout

One server (``tools.server.open_server``: ``app:app`` under hypercorn, ``--model``, from
this checkout or ``--tree``, another one, to measure the code before a change: its
settings then say nothing of the watcher caps, which it may not know). For each count W
of ``--watchers``: W clients read ``GET /scope/events`` (reading every byte and parsing
nothing, as a cheap page would), and with them open, ``--runs`` requests one after the
other each take ``--tokens`` tokens (``POST /v1/generate``, greedy, end of sequence
off); each request's wall time is recorded, and the serving process's CPU seconds
(``/proc``) per token. Every watcher of a server without keys sees one view (every
row), as the watchers of one key do (issue 43, item 5: 400 watchers made another key's
100 tokens take 1.4 to 3.4 s instead of 0.2 to 0.4 s). This checkout's server is started
with ``STREAMSCOPE_SCOPE_MAX_WATCHERS`` at the largest W (its caps refuse more).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import trio

from tools.scopebench import cpu_s, serving_pid
from tools.server import REPO_ROOT, open_server

PROMPT = "The history of the river is"


async def watch(url: str,
                task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Read one feed until cancelled, every byte, parsing nothing. Cancellation: the
    way it stops (the count's end); nothing to undo: httpx closes the connection."""
    async with httpx.AsyncClient(base_url=url, timeout=None, trust_env=False) as http, \
            http.stream("GET", "/scope/events") as response:
        response.raise_for_status()
        task_status.started()
        async for _ in response.aiter_raw():
            pass


async def timed_requests(url: str, tokens: int, runs: int) -> list[float]:
    """Wall seconds of each of ``runs`` requests of ``tokens`` tokens, one at a time."""
    spent = []
    async with httpx.AsyncClient(base_url=url, timeout=120.0, trust_env=False) as http:
        for _ in range(runs):
            started = time.perf_counter()
            answer = await http.post("/v1/generate", json={
                "prompt": PROMPT, "max_new_tokens": tokens, "temperature": 0,
                "ignore_eos": True})
            answer.raise_for_status()
            spent.append(time.perf_counter() - started)
    return spent


async def one_count(url: str, pid: int, watchers: int, args: argparse.Namespace
                    ) -> dict[str, Any]:
    """The requests' times with ``watchers`` feeds open."""
    async with trio.open_nursery() as nursery:
        for _ in range(watchers):
            await nursery.start(watch, url)
        await trio.sleep(0.5)  # every snapshot written: what is measured is the frames
        cpu_before = cpu_s(pid)
        spent = await timed_requests(url, args.tokens, args.runs)
        cpu = cpu_s(pid) - cpu_before
        nursery.cancel_scope.cancel(reason="the count is measured")
    return {"watchers": watchers, "seconds": [round(s, 3) for s in spent],
            "median_s": round(statistics.median(spent), 3),
            "min_s": round(min(spent), 3), "max_s": round(max(spent), 3),
            "server_cpu_ms_per_token": round(cpu * 1000 / (args.tokens * args.runs), 3)}


async def run(args: argparse.Namespace, tree: Path) -> dict[str, Any]:
    counts = [int(n) for n in args.watchers.split(",")]
    settings: dict[str, object] = {"model": args.model}
    if tree == REPO_ROOT:
        settings["scope_max_watchers"] = max(max(counts), 1)
    env = {"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    began = time.time()
    async with open_server(settings, env=env, tree=tree) as url:
        await timed_requests(url, 8, 2)  # warm-up
        pid = serving_pid(url)
        rows = []
        for watchers in counts:
            rows.append(await one_count(url, pid, watchers, args))
            print(json.dumps(rows[-1]), file=sys.stderr)
    return {"model": args.model, "tree": str(tree), "tokens": args.tokens, "runs": args.runs,
            "threads": args.threads, "seconds": round(time.time() - began, 1),
            "load_average": os.getloadavg(), "counts": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-gpt2")
    parser.add_argument("--watchers", default="0,64,400", help="comma-separated counts")
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--runs", type=int, default=5, help="requests a count")
    parser.add_argument("--threads", type=int, default=1, help="torch's intra-op threads")
    parser.add_argument("--tree", help="serve another checkout (the code before a change)")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args(argv)
    data = trio.run(run, args, Path(args.tree).resolve() if args.tree else REPO_ROOT)
    text = json.dumps(data, indent=2)
    print(text)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
