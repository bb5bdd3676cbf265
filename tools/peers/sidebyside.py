"""streamscope and ``transformers serve --continuous-batching``, side by side in one run.

::

    flock /tmp/streamscope-bench.lock python -m tools.peers.sidebyside \\
        --json results/sidebyside.json --plot docs/plots/sidebyside.png

One command, one machine, one system after the other, the same client (``tools.load``):

1. the bare decode ceiling: ``python -m tools.bench step --batches 32`` (the engine's
   decode step at batch 32; ceiling = 32 tokens per step) and the time of one packed
   prefill of all 32 prompts (``python -m tools.bench prefill --variants packed``), both as
   subprocesses with the same thread setting as the servers;
2. streamscope (``tools.server.open_server``: ``app:app`` under hypercorn, STREAMSCOPE_*
   from the environment), then the peer (``tools.peers.transformers_serve.open_peer``, the
   same float32 weights); each is warmed up with two short streams (not counted), then
   driven at each level N of ``--levels``: N concurrent connections, ``--requests`` streams in all
   (``--baseline-requests`` at N = 1, back to back), prompts from ``tools/prompts.txt``,
   ``--max-new-tokens`` greedy tokens, end of sequence off.

Both are driven over the same OpenAI route, ``POST /v1/completions`` (streaming; ours
sends a chunk per token, the peer sometimes two tokens' text in one; ours gets
``"ignore_eos": true``, the peer its own ``generation_config`` with ``"eos_token_id":
-1``, see ``tools/wire.py``), so one parser reads both. ``--threads`` sets
``OMP_NUM_THREADS`` and ``MKL_NUM_THREADS`` for every
process started here (torch's intra-op threads), the same for both systems.

The JSON holds, per system and level, the load summary plus the longest gap, each
stream's token count and times (``stream_records``) and, where the server reports ``usage``, its
own token count (the peer's; ``tokens_per_s_counted`` uses it, as a chunk may hold more or
less than a token),
and the ratios ours / peer; and the targets of issue 10 section 2 at the largest level:
tokens/s against the decode ceiling (>= 0.8) and against the peer (>= 2), TTFT p99
against 1.3 x (one packed prefill of all prompts + one decode step). Beside them, the
tokens/s of the plainest batched schedule of the same passes (``reference_tokens_per_s``):
one packed prefill of all N prompts, then ``--max-new-tokens`` - 1 decode steps at batch
N, and each system's share of it; a scheduler can beat it only by making decode rows
cheaper than a full decode step (riding in prefill passes), not by batching better.
``--no-peer`` runs ours alone (the tests' quick form).

``--llama`` adds llama.cpp's ``llama-server`` (``tools.peers.llama_server``: the binary
``python -m tools.peers.llama_build`` built, on the shipped Q4_1 GGUF file, ``--parallel`` the
largest level, ``-t``/``-tb`` ``--threads``), driven by the same client on the same route
with ``ignore_eos`` and ``cache_prompt: false`` (``--protocol llama``); which build ran
(native or portable) is in ``meta.llama_build``, and ``ratios_ours_over_llama`` and
``llama_targets`` (issue 37: one stream at least 0.5x its tokens/s, the largest level at
least 2x, TTFT p99 there no worse) are beside the peer's. ``--no-transformers`` leaves the
``transformers serve`` peer out.

``--before TREE`` runs another checkout's server (its ``app:app``, its code on the path)
right before ours, on the same client and settings: ``systems["streamscope-before"]``,
``ratios_ours_over_before``, and ``before_targets`` (its shares of this tree's ceiling and
reference schedule, its ratio to the peer), so "no slower than before" is one run's ratio;
``--before-unset`` keeps variables from it (e.g. a ``STREAMSCOPE_`` setting it predates).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import trio

from tools.load_runner import run_load
from tools.prompts import load_prompts
from tools.records import LoadResult
from tools.server import REPO_ROOT, open_server

LEVELS = (1, 8, 32)
TTFT_SLACK = 1.3  # issue 10: TTFT p99 within 1.3 x (one batched prefill + one step)
CEILING_SHARE = 0.8  # issue 10: at least 80% of the decode ceiling
PEER_FACTOR = 2.0  # issue 10: at least 2x the peer's tokens/s
OURS, BEFORE = "streamscope", "streamscope-before"
LLAMA_ONE_STREAM = 0.8  # issue 44 (37 asked 0.5): one stream at least 0.8x llama-server's tokens/s
LLAMA_FACTOR = 2.0  # issue 37: the largest level at least 2x llama-server's
COMPARED = ("tokens_per_s_counted", "ttft_p50_ms", "ttft_p99_ms", "gap_p50_ms", "gap_p99_ms",
            "gap_max_ms")


def thread_env(threads: int) -> dict[str, str]:
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def _run_bench(name: str, args: list[str], env: Mapping[str, str]) -> dict[str, Any]:
    """Run ``python -m tools.bench NAME args`` in its own process; return what it wrote."""
    with tempfile.TemporaryDirectory() as scratch:
        subprocess.run([sys.executable, "-m", "tools.bench", name, *args, "--out", scratch],
                       check=True, cwd=REPO_ROOT, env={**os.environ, **env}, stdout=sys.stderr)
        data: dict[str, Any] = json.loads(Path(scratch, f"{name}.json").read_text())
        return data


def measure_ceiling(model: str, batch: int, env: Mapping[str, str]) -> dict[str, Any]:
    """The engine's decode step at ``batch`` and one packed prefill of ``batch`` prompts,
    in the precision the server runs (``STREAMSCOPE_DTYPE``, the app's default auto)."""
    precision = ["--precision", os.environ.get("STREAMSCOPE_DTYPE", "auto")]
    step = _run_bench("step", ["--model", model, "--batches", str(batch), "--steps", "8",
                               "--warmup", "2", *precision], env)
    prefill = _run_bench("prefill", ["--model", model, "--prompts", str(batch), "--rounds", "2",
                                     "--variants", "packed", *precision], env)
    step_ms = float(step["rows"][0]["engine_ms"])
    prefill_ms = float(prefill["rows"][0]["median_ms"])
    return {
        "batch": batch,
        "step_ms": step_ms,
        "tokens_per_s": round(batch * 1000 / step_ms, 2),
        "packed_prefill_ms": prefill_ms,
        "prefill_prompt_tokens": prefill["summary"]["prompt_tokens"],
        "ttft_bound_ms": round(TTFT_SLACK * (prefill_ms + step_ms), 1),
    }


def level_figures(result: LoadResult) -> dict[str, Any]:
    figures = result.summary()
    gaps = [g for r in result.records for g in r.gaps_s()]
    figures["gap_max_ms"] = None if not gaps else round(max(gaps) * 1000, 2)
    figures["tokens_per_stream"] = sorted({r.tokens for r in result.records})
    figures["finish_reasons"] = sorted({str(r.finish_reason or r.error) for r in result.records})
    # A chunk is counted as a token (tools/wire.py); a server that reports usage says
    # how many it made: the peer may put two tokens' text in one chunk, or send none for
    # a token whose text is held back. Where every stream reports usage, its count is
    # the one compared (``tokens_per_s_counted``).
    usage = [u for r in result.records
             if isinstance(u := (r.usage or {}).get("completion_tokens"), int)]
    figures["tokens_per_s_counted"] = figures["tokens_per_s"]
    if result.records and len(usage) == len(result.records):
        figures["usage_completion_tokens"] = sorted(set(usage))
        makespan = figures["makespan_s"]
        figures["tokens_per_s_counted"] = round(sum(usage) / makespan, 2) if makespan else None
    return figures


async def drive(
    url: str, protocol: str, levels: list[int], *, requests: int, baseline_requests: int,
    max_new_tokens: int, progress: bool,
) -> dict[str, Any]:
    """Warm the server up, then every level in turn; figures per level."""
    prompts = load_prompts()
    await run_load(url, prompts, clients=2, max_new_tokens=4, ignore_eos=True,
                   protocol=protocol, progress=False)
    out: dict[str, Any] = {}
    for n in levels:
        started = time.monotonic()
        result = await run_load(
            url, prompts, clients=n, requests=baseline_requests if n == 1 else requests,
            max_new_tokens=max_new_tokens, ignore_eos=True, protocol=protocol,
            progress=progress)
        figures = level_figures(result)
        figures["wall_s"] = round(time.monotonic() - started, 1)
        # each stream's own times (sent, token arrivals, from the level's start): where
        # a long TTFT or gap came from
        figures["stream_records"] = result.to_json()["streams"]
        out[str(n)] = figures
        print(f"  N={n}: {_line(figures)}", file=sys.stderr)
    return out


def _line(f: Mapping[str, Any]) -> str:
    return (f"{f['tokens_per_s_counted']} tok/s, "
            f"TTFT p50/p99 {f['ttft_p50_ms']}/{f['ttft_p99_ms']} ms, "
            f"gap p50/p99/max {f['gap_p50_ms']}/{f['gap_p99_ms']}/{f['gap_max_ms']} ms, "
            f"errors {f['errors']}")


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 3)


def compare(ours: Mapping[str, Any], peer: Mapping[str, Any]) -> dict[str, Any]:
    """ours / peer for each compared figure at each level both ran."""
    return {n: {k: _ratio(ours[n].get(k), peer[n].get(k)) for k in COMPARED}
            for n in ours if n in peer}


def llama_targets(ours: Mapping[str, Any], llama: Mapping[str, Any],
                  level: int) -> dict[str, Any]:
    """Issue 37's targets against llama-server: one stream, the largest level's tokens/s
    and its TTFT p99."""
    out: dict[str, Any] = {"level": level}
    if "1" in ours and "1" in llama:
        one = _ratio(ours["1"]["tokens_per_s_counted"], llama["1"]["tokens_per_s_counted"])
        out.update(one_stream_over_llama=one,
                   one_stream_met=one is not None and one >= LLAMA_ONE_STREAM)
    at, theirs = ours.get(str(level)), llama.get(str(level))
    if at is not None and theirs is not None:
        over = _ratio(at["tokens_per_s_counted"], theirs["tokens_per_s_counted"])
        ttft = _ratio(at["ttft_p99_ms"], theirs["ttft_p99_ms"])
        out.update(over_llama=over, over_llama_met=over is not None and over >= LLAMA_FACTOR,
                   ttft_p99_over_llama=ttft, ttft_p99_met=ttft is not None and ttft <= 1.0)
    return out


def targets(ours: Mapping[str, Any], peer: Mapping[str, Any] | None,
            ceiling: Mapping[str, Any] | None, level: int,
            max_new_tokens: int | None = None) -> dict[str, Any]:
    at = ours.get(str(level))
    if at is None:
        return {}
    out: dict[str, Any] = {"level": level}
    peer_at = None if peer is None else peer.get(str(level))
    if ceiling is not None:
        share = _ratio(at["tokens_per_s_counted"], ceiling["tokens_per_s"])
        out["of_ceiling"] = share
        out["of_ceiling_met"] = share is not None and share >= CEILING_SHARE
        ttft = _ratio(at["ttft_p99_ms"], ceiling["packed_prefill_ms"] + ceiling["step_ms"])
        out["ttft_p99_over_prefill_plus_step"] = ttft
        out["ttft_p99_met"] = ttft is not None and ttft <= TTFT_SLACK
        if max_new_tokens is not None:  # one packed prefill, then the decode steps
            work_ms = ceiling["packed_prefill_ms"] + (max_new_tokens - 1) * ceiling["step_ms"]
            reference = level * max_new_tokens * 1000 / work_ms
            out["reference_tokens_per_s"] = round(reference, 2)
            out["of_reference"] = _ratio(at["tokens_per_s_counted"], reference)
            if peer_at is not None:
                out["peer_of_reference"] = _ratio(peer_at["tokens_per_s_counted"], reference)
    if peer_at is not None:
        over = _ratio(at["tokens_per_s_counted"], peer_at["tokens_per_s_counted"])
        out["over_peer"] = over
        out["over_peer_met"] = over is not None and over >= PEER_FACTOR
    return out


async def run_side_by_side(args: argparse.Namespace) -> dict[str, Any]:
    env = thread_env(args.threads)
    levels = sorted(set(args.levels))
    began = time.time()
    load_before = os.getloadavg()
    ceiling = None
    if not args.no_ceiling:
        print("decode ceiling and packed prefill ...", file=sys.stderr)
        ceiling = await trio.to_thread.run_sync(measure_ceiling, args.model, max(levels), env)
    common = {"requests": args.requests, "baseline_requests": args.baseline_requests,
              "max_new_tokens": args.max_new_tokens, "progress": not args.no_progress}
    systems: dict[str, Any] = {}

    async def one(name: str, start: Callable[[], AbstractAsyncContextManager[str]],
                  protocol: str) -> None:
        print(f"{name} ...", file=sys.stderr)
        started, load_at_start = time.monotonic(), os.getloadavg()
        async with start() as url:
            figures = await drive(url, protocol, levels, **common)
        systems[name] = {"protocol": protocol, "levels": figures,
                         "wall_s": round(time.monotonic() - started, 1),
                         "loadavg_start_end": [round(load_at_start[0], 2),
                                               round(os.getloadavg()[0], 2)]}

    async def run_ours() -> None:
        if args.before is not None:
            await one(BEFORE, lambda: open_server({"model": args.model}, env=env,
                                                  tree=args.before, unset=args.before_unset),
                      "openai")
        await one(OURS, lambda: open_server({"model": args.model}, env=env), "openai")

    async def run_peer() -> None:
        from tools.peers.transformers_serve import PEER_NAME, open_peer

        await one(PEER_NAME, lambda: open_peer(env=env), "transformers")

    async def run_llama() -> None:
        from tools.peers.llama_server import LLAMA_NAME, open_llama

        await one(LLAMA_NAME, lambda: open_llama(threads=args.threads, parallel=max(levels),
                                                 env=env), "llama")

    peers = [] if args.no_peer else [run_peer] * (not args.no_transformers) + [
        run_llama] * args.llama
    order = [*peers, run_ours] if args.peer_first else [run_ours, *peers]
    for run in order:
        await run()
    ours = systems[OURS]["levels"]
    peer = next((s["levels"] for name, s in systems.items()
                 if name not in (OURS, BEFORE, "llama-server")), None)
    llama = systems.get("llama-server", {}).get("levels")
    before = systems.get(BEFORE, {}).get("levels")
    return {
        "meta": {
            "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(began)),
            "wall_s": round(time.time() - began, 1),
            "model": args.model, "threads": args.threads, "levels": levels,
            "requests": args.requests, "baseline_requests": args.baseline_requests,
            "max_new_tokens": args.max_new_tokens, "eos": "off on every system",
            "order": list(systems),
            "route": "POST /v1/completions, streaming, on every system",
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
            "streamscope_env": {k: v for k, v in os.environ.items()
                                if k.startswith("STREAMSCOPE_")},
            "command": "python -m tools.peers.sidebyside " + " ".join(args.argv),
            "llama_build": _llama_build() if args.llama and not args.no_peer else None,
            "before_tree": None if args.before is None else str(args.before),
        },
        "ceiling": ceiling,
        "systems": systems,
        "ratios_ours_over_peer": None if peer is None else compare(ours, peer),
        "targets": targets(ours, peer, ceiling, max(levels), args.max_new_tokens),
        "ratios_ours_over_llama": None if llama is None else compare(ours, llama),
        "llama_targets": None if llama is None else llama_targets(ours, llama, max(levels)),
        "ratios_ours_over_before": None if before is None else compare(ours, before),
        "before_targets": None if before is None else targets(
            before, peer, ceiling, max(levels), args.max_new_tokens),
    }


def _llama_build() -> dict[str, Any] | None:
    """Which llama-server ran: its path and build record (``tools.peers.llama_build``)."""
    from tools.peers.llama_build import built_variant

    found = built_variant()
    return None if found is None else {"binary": str(found[0]), **found[1]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.peers.sidebyside", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2",
                        help="our server's model; the peer always runs the embedded one")
    parser.add_argument("--levels", type=int, nargs="+", default=list(LEVELS))
    parser.add_argument("--requests", type=int, default=32, help="streams per level N > 1")
    parser.add_argument("--baseline-requests", type=int, default=8,
                        help="streams at N = 1, back to back")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch threads, every process")
    parser.add_argument("--no-peer", action="store_true", help="streamscope alone")
    parser.add_argument("--llama", action="store_true",
                        help="add llama-server (python -m tools.peers.llama_build first)")
    parser.add_argument("--no-transformers", action="store_true",
                        help="leave the transformers serve peer out")
    parser.add_argument("--peer-first", action="store_true",
                        help="run the peer before ours (to see the order's effect)")
    parser.add_argument("--no-ceiling", action="store_true",
                        help="skip the step and prefill benches")
    parser.add_argument("--before", type=Path, default=None,
                        help="another checkout whose server runs right before ours")
    parser.add_argument("--before-unset", nargs="+", default=[], metavar="VARIABLE",
                        help="variables kept from the --before server (settings it lacks)")
    parser.add_argument("--json", type=Path, default=Path("results/sidebyside.json"))
    parser.add_argument("--plot", type=Path, default=None, help="a PNG of TTFT and gaps vs N")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    data = trio.run(run_side_by_side, args)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(data, indent=1))
    if args.plot:
        from tools.peers.sidebyside_chart import draw

        draw(data, args.plot)
    print(json.dumps({"ceiling": data["ceiling"], "ratios": data["ratios_ours_over_peer"],
                      "targets": data["targets"], "llama": data["llama_targets"],
                      "over_before": data["ratios_ours_over_before"],
                      "before_targets": data["before_targets"]}, indent=1))
    errors = sum(lv["errors"] for s in data["systems"].values() for lv in s["levels"].values())
    return 0 if errors == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
