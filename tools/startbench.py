"""How long a start takes, phase by phase: ours (two ways) and the peer's, in one run.

::

    flock /tmp/streamscope-bench.lock python -m tools.startbench --json results/startbench.json
    python -m tools.startbench --before /tmp/streamscope-head   # another tree's code beside
    python -m tools.startbench --quick --json /tmp/start.json   # tiny model, seconds (a test)

Systems, each started once untimed (``--warmup``: files into the page cache, a converted
copy made), then ``--repeats`` times in turn (rotating which goes first):

* ``serve``: ``streamscope serve --bind 127.0.0.1:0`` (``app.cli``);
* ``hypercorn``: ``python -m hypercorn -k trio app:app --bind 127.0.0.1:0``;
* the same two from the source tree ``--before`` (``before-serve``, ``before-hypercorn``:
  ``PYTHONPATH`` and the working directory set to it), to measure a change against the
  code before it in the same run;
* ``peer``: ``transformers serve --continuous-batching`` on the same float32 weights
  (``tools.peers.transformers_serve``; its folder is made before anything is timed). Not
  with ``--quick``.

For each start: ``listening_s`` (spawned until the process logged its address: the
interpreter, the imports, for ``hypercorn`` the app's build), ``ready_s`` (spawned until
``/ready``, the peer's ``/health``, first answered 200; polled every ``POLL_S``), the
server's own ``start_phases_s`` from ``/stats`` (``engine.startup``: imports, tokenizer,
weights, GGUF conversion, engine set-up, cache, calibration, ``gc_freeze``,
``process_until_load``; ``unphased_s``: the rest of ``ready_s``),
the first request (one stream of ``FIRST_TOKENS`` tokens: its TTFT and its end, from
spawn too, as a client that waits for ``/ready`` and asks at once sees it), and the RSS
of the server's process tree after the start (``rss_ready_mb``). The first start of each
system also runs ``--streams`` concurrent streams of ``--max-new-tokens`` tokens and
records the RSS after them (``rss_after_streams_mb``).

Also measured in the same run: ``interpreter_rss_mb``, the RSS of a Python that imported
what the server imports (torch, transformers' modelling code, the app) and built no
model, and the weights' bytes (the converted float32 copy), for the issue's memory target:
RSS at idle <= 1.5 x weights + interpreter. ``--cold`` adds one start of ``serve`` with an
empty cache directory (``XDG_CACHE_HOME``): a first start, which converts the GGUF file.
The machine's load average is recorded before and after every start.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
import trio

from tools.load_runner import run_load
from tools.prompts import load_prompts
from tools.server import REPO_ROOT, LoggedProcess, ServerError

POLL_S = 0.02  # readiness polling: the start's resolution
READY_TIMEOUT_S = 300.0
STOP_GRACE_S = 10.0
FIRST_TOKENS = 8
RSS_TARGET_FACTOR = 1.5  # issue 27: RSS at idle <= 1.5 x weights + interpreter
READY_TARGET_S = 5.0  # issue 27: /ready within 5 s on this machine
_LISTENING = re.compile(rb"(?:listening on|Running on|Uvicorn running on) (http://127\.0\.0\.1:\d+)")
_INTERPRETER = ("import torch, transformers.modeling_utils, app.factory, hypercorn.trio\n"
                "print(open('/proc/self/status').read().split('VmRSS:')[1].split()[0])")
_LAUNCH_SERVE = "import sys; from app.cli import main; sys.exit(main())"


def command_of(system: str) -> tuple[list[str], str, str]:
    """(command, readiness path, wire protocol) of a system; a ``before-`` one the same."""
    kind = system.removeprefix("before-")
    if kind == "serve":
        return ([sys.executable, "-c", _LAUNCH_SERVE, "serve", "--bind", "127.0.0.1:0"],
                "/ready", "openai")
    if kind == "hypercorn":
        return ([sys.executable, "-m", "hypercorn", "-k", "trio", "app:app",
                 "--bind", "127.0.0.1:0"], "/ready", "openai")
    if kind == "peer":
        from tools.peers.transformers_serve import peer_command, peer_model_dir

        return peer_command(peer_model_dir()), "/health", "transformers"
    raise ValueError(f"unknown system {system!r}")


def _status_kb(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "RssAnon", "RssFile"):
            fields[name] = int(value.split()[0])
    return fields


def _descendants(pid: int) -> list[int]:
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    found, frontier = [], [pid]
    while frontier:
        children = [c for c, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def tree_rss_mb(pid: int) -> dict[str, float]:
    """RSS of a process and its children (hypercorn serves from a child), from /proc: the
    sum, and the largest one's (the process that holds the model) with its anonymous and
    file-backed parts (the weights are a mapped file until the first pass reads them)."""
    sizes = []
    for each in [pid, *_descendants(pid)]:
        try:
            sizes.append(_status_kb(each))
        except (OSError, ValueError):
            continue
    if not sizes:
        return {}
    largest = max(sizes, key=lambda f: f.get("VmRSS", 0))
    return {"total": round(sum(f.get("VmRSS", 0) for f in sizes) / 1024, 1),
            "largest": round(largest.get("VmRSS", 0) / 1024, 1),
            "largest_anon": round(largest.get("RssAnon", 0) / 1024, 1),
            "largest_file": round(largest.get("RssFile", 0) / 1024, 1)}


async def start_once(system: str, args: argparse.Namespace, env: Mapping[str, str],
                     *, with_streams: bool) -> dict[str, Any]:
    command, ready_path, protocol = command_of(system)
    tree = args.before if system.startswith("before-") else REPO_ROOT
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMSCOPE_")}
    full_env.update(env)
    full_env.update({"STREAMSCOPE_" + k.upper(): str(v) for k, v in args.settings.items()})
    if tree != REPO_ROOT:
        full_env["PYTHONPATH"] = str(tree)
    load_before = os.getloadavg()[0]
    process = LoggedProcess(command, full_env, running_on=_LISTENING, name=system, cwd=tree)
    out: dict[str, Any] = {"system": system, "loadavg_before": round(load_before, 2)}
    try:
        async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
            url = None
            while True:
                if url is None and (url := process.check(READY_TIMEOUT_S)) is not None:
                    out["listening_s"] = round(time.monotonic() - process.started, 3)
                process.check(READY_TIMEOUT_S)
                try:
                    if url and (await client.get(url + ready_path)).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                await trio.sleep(POLL_S)
            out["ready_s"] = round(time.monotonic() - process.started, 3)
            out["rss_ready_mb"] = tree_rss_mb(process.proc.pid)
            if ready_path == "/ready":
                stats = (await client.get(url + "/stats")).json()
                out["start_phases_s"] = phases = stats.get("start_phases_s")
                if phases:  # what no phase covers: the hub's start, /ready's poll, exec
                    out["unphased_s"] = round(out["ready_s"] - sum(phases.values()), 3)
                out["blocks_total"] = stats.get("blocks_total")
        first = await run_load(url, load_prompts(), clients=1, max_new_tokens=FIRST_TOKENS,
                               ignore_eos=True, protocol=protocol, progress=False)
        record = first.records[0]
        out["first_request"] = {
            "ok": record.ok, "tokens": record.tokens,
            "ttft_s": None if record.ttft_s is None else round(record.ttft_s, 3),
            "total_s": None if record.duration_s is None else round(record.duration_s, 3)}
        out["first_token_from_spawn_s"] = (
            None if record.ttft_s is None else round(out["ready_s"] + record.ttft_s, 3))
        if with_streams:
            result = await run_load(url, load_prompts(), clients=args.streams,
                                    max_new_tokens=args.max_new_tokens, ignore_eos=True,
                                    protocol=protocol, progress=False)
            summary = result.summary()
            out["streams"] = {k: summary[k] for k in ("streams", "streams_ok", "errors",
                                                      "tokens", "makespan_s", "tokens_per_s")}
            out["rss_after_streams_mb"] = tree_rss_mb(process.proc.pid)
    finally:
        process.interrupt()
        with trio.CancelScope(shield=True), trio.move_on_after(STOP_GRACE_S):
            while process.proc.poll() is None:  # noqa: ASYNC110
                await trio.sleep(0.05)
        process.kill()
    out["loadavg_after"] = round(os.getloadavg()[0], 2)
    print(f"  {system}: ready {out['ready_s']} s, RSS {out['rss_ready_mb']} MB, phases "
          f"{out.get('start_phases_s')}", file=sys.stderr)
    return out


def interpreter_rss_mb(env: Mapping[str, str]) -> float:
    done = subprocess.run([sys.executable, "-c", _INTERPRETER], cwd=REPO_ROOT, check=True,
                          capture_output=True, text=True, env={**os.environ, **env})
    return round(int(done.stdout.split()[-1]) / 1024, 1)


def weights_mb(model: str) -> float | None:
    """The float32 weights' size: the embedded model's converted copy, if there is one."""
    if model != "smollm2":
        return None
    from engine.model import converted_copy_dir

    file = converted_copy_dir() / "model.safetensors"
    return round(file.stat().st_size / 2**20, 1) if file.is_file() else None


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per system: the median (and every value) of the start's figures and phases."""
    out: dict[str, Any] = {}
    for system in dict.fromkeys(r["system"] for r in runs):
        mine = [r for r in runs if r["system"] == system]
        figures: dict[str, Any] = {}
        for key in ("listening_s", "ready_s", "first_token_from_spawn_s", "unphased_s"):
            values = [r[key] for r in mine if r.get(key) is not None]
            if values:
                figures[key] = {"median": round(statistics.median(values), 3), "all": values}
        phases: dict[str, list[float]] = {}
        for r in mine:
            for name, s in (r.get("start_phases_s") or {}).items():
                phases.setdefault(name, []).append(s)
        figures["start_phases_median_s"] = {n: round(statistics.median(v), 3)
                                            for n, v in phases.items()}
        figures["rss_ready_mb_median"] = statistics.median(
            r["rss_ready_mb"]["largest"] for r in mine if r.get("rss_ready_mb"))
        streamed = next((r for r in mine if "rss_after_streams_mb" in r), None)
        if streamed is not None:
            figures["rss_after_streams_mb"] = streamed["rss_after_streams_mb"]
            figures["streams"] = streamed["streams"]
        out[system] = figures
    return out


def targets(summary: Mapping[str, Any], interpreter: float, weights: float | None
            ) -> dict[str, Any]:
    out: dict[str, Any] = {}
    peer = summary.get("peer", {}).get("ready_s", {}).get("median")
    for system in ("serve", "hypercorn"):
        if system not in summary:
            continue
        ready = summary[system]["ready_s"]["median"]
        mine: dict[str, Any] = {"ready_s": ready, "ready_within_5s": ready <= READY_TARGET_S}
        if peer:
            mine["ready_over_peer"] = round(ready / peer, 3)
            mine["ready_within_peer"] = ready <= peer
        if weights is not None:
            bound = RSS_TARGET_FACTOR * weights + interpreter
            rss = summary[system]["rss_ready_mb_median"]
            mine.update(rss_idle_mb=rss, rss_bound_mb=round(bound, 1), rss_met=rss <= bound)
        out[system] = mine
    return out


async def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    env = {} if args.threads is None else {"OMP_NUM_THREADS": str(args.threads),
                                           "MKL_NUM_THREADS": str(args.threads)}
    systems = list(args.systems)
    if args.before is not None:
        systems += [f"before-{s}" for s in args.systems if s != "peer"]
    if "peer" in systems:  # its folder is made once, untimed
        from tools.peers.transformers_serve import peer_model_dir

        await trio.to_thread.run_sync(peer_model_dir)
    began, load_before = time.time(), os.getloadavg()
    warmups = []
    for system in systems if args.warmup else ():  # untimed: files in the page cache
        print(f"warm-up start: {system}", file=sys.stderr)
        warmups.append(await start_once(system, args, env, with_streams=False))
    runs: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        turn = systems[repeat % len(systems):] + systems[:repeat % len(systems)]
        print(f"round {repeat + 1}/{args.repeats}: {', '.join(turn)}", file=sys.stderr)
        for system in turn:
            run = await start_once(system, args, env, with_streams=repeat == 0)
            runs.append({**run, "round": repeat})
    cold = None
    if args.cold:
        with tempfile.TemporaryDirectory() as home:
            print("cold start (empty cache directory) ...", file=sys.stderr)
            cold = await start_once("serve", args, {**env, "XDG_CACHE_HOME": home},
                                    with_streams=False)
    interpreter = interpreter_rss_mb(env)
    weights = weights_mb(args.model)
    summary = summarise(runs)
    return {
        "meta": {
            "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(began)),
            "wall_s": round(time.time() - began, 1), "model": args.model,
            "threads": args.threads, "repeats": args.repeats, "systems": systems,
            "settings": args.settings, "before": None if args.before is None else str(args.before),
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
            "cpus": os.cpu_count(), "poll_s": POLL_S,
            "command": "python -m tools.startbench " + " ".join(args.argv),
        },
        "interpreter_rss_mb": interpreter,
        "weights_mb": weights,
        "summary": summary,
        "targets": targets(summary, interpreter, weights),
        "cold": cold,
        "runs": runs,
        "warmups": warmups,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tools.startbench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--systems", nargs="+", default=["serve", "hypercorn", "peer"],
                        choices=["serve", "hypercorn", "peer"])
    parser.add_argument("--before", type=Path, default=None,
                        help="a source tree whose serve and hypercorn run beside")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None,
                        help="OMP_NUM_THREADS for every server (default: torch's own)")
    parser.add_argument("--set", dest="settings", action="append", default=[],
                        metavar="NAME=VALUE", help="a STREAMSCOPE_ setting for ours")
    parser.add_argument("--warmup", type=int, choices=[0, 1], default=1,
                        help="one untimed start of each system first (default 1)")
    parser.add_argument("--cold", action="store_true",
                        help="also one start of serve with an empty cache directory")
    parser.add_argument("--quick", action="store_true",
                        help="tiny-gpt2, ours only, one round, 4 streams of 4 tokens")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--no-progress", action="store_true", help="(accepted; no bars)")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.settings = dict(s.split("=", 1) for s in args.settings)
    if args.quick:
        args.model, args.repeats, args.streams, args.max_new_tokens = "tiny-gpt2", 1, 4, 4
        args.warmup = 0
        args.systems = [s for s in args.systems if s != "peer"]
        args.settings.setdefault("cache_blocks", "256")
    args.settings.setdefault("model", args.model)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        data = trio.run(run_bench, args)
    except ServerError as exc:
        print(exc, file=sys.stderr)
        return 1
    text = json.dumps(data, indent=2)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    print(json.dumps({"summary": data["summary"], "targets": data["targets"]}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
