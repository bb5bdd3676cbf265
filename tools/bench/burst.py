"""A burst of arrivals and a long prompt, in the engine itself: TTFT and gaps per setting.

``python -m tools.bench burst`` loads the embedded model once and runs,
for each engine setting, one after another in the same process (so that they share
the machine's load), two scenarios with no HTTP in between (times are taken in the
stepping thread, when ``step()`` hands an event out):

* ``burst``: the experiments' 32 prompts arrive together at an idle engine, greedy,
  ``--burst-tokens`` new tokens each. Reported: TTFT p50/p99/max, the gaps between a
  stream's tokens (p50/p99/max), tokens/s over the whole burst, and its ratio to the
  bare decode ceiling measured first in the same run (32 / the median of decode steps
  with all 32 running, after one packed prefill; also the run's warm-up), and TTFT p99
  against that one packed prefill of all 32 plus one decode step (``ttft_p99_of_one``).
  Throughput also per CPU second of this process (``tokens_per_cpu_s``, against the
  ceiling's own): on a shared machine the wall clock counts the others' work too, the
  CPU time (with ``--threads 1``) only this run's.
* ``waves``: the same 32 prompts in 4 waves of 8, one step apart (as arrivals over
  HTTP land in different steps): the earlier waves decode while the later ones are
  prefilled, so the gaps show what a burst costs running streams. TTFT from each
  request's own arrival.
* ``long``: 16 streams decode; a prompt of ``--long-tokens`` tokens arrives. Reported:
  the running streams' gaps from its arrival to its first token (p50/p99/max), and
  its TTFT; then (``again``) the same for a second such prompt after it, whose steps
  are planned with the margin (``engine.costs``) the first one's steps left.

Settings: ``serial`` (one prefill pass per prompt, 256 prompt tokens a step: the
engine before issue 10, except that a long prompt is now chunked; the engine's runner
wrapped in ``tools.serial_prefill.SerialPrefill``), ``whole`` (one
pass for every waiting prompt, whole: a 4096-token budget), ``budget-256``, and
``step-target`` (``max_step_ms``: ``--step-ms``, or by default twice the calibrated
decode pass at batch 32), each with a step's prefill and decode in two forward
passes; ``budget-256-mixed`` (the default engine) and ``step-target-mixed`` are the
last two with the mixed step (one forward pass a step), and ``step-target-mixed-flat``
the last without counting a chunk's cached prefix in its cost.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

from engine import EngineEvent, GenerationRequest, SamplingParams, TokenEvent, costs
from engine.costs import PREFIX_POSITIONS
from engine.engine import Engine
from engine.model import LoadedModel, load_model
from engine.model_runner import ModelRunner
from tools.bench.common import bench
from tools.lab.common import Report
from tools.prompts import load_prompts
from tools.serial_prefill import SerialPrefill

FIXED = SamplingParams(ignore_eos=True)
Options = dict[str, Any]


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 1)


class Recorder:
    """Times (s since ``t0``) at which each request's tokens came out of the engine."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.cpu0 = time.process_time()  # the process's CPU time: what the work cost
        self.times: dict[str, list[float]] = {}

    def __call__(self, events: list[EngineEvent]) -> None:
        now = time.perf_counter() - self.t0
        for event in events:
            if isinstance(event, TokenEvent):
                self.times.setdefault(event.request_id, []).append(now)

    def step(self, engine: Engine) -> float:
        """One step; its duration in seconds."""
        started = time.perf_counter()
        self(engine.step(on_prefill=self))
        return time.perf_counter() - started


def _submit(engine: Engine, request_id: str, ids: list[int], max_new: int) -> None:
    engine.submit(GenerationRequest(request_id, "", max_new, sampling=FIXED,
                                    prompt_token_ids=tuple(ids)))


def burst(
    engine: Engine, prompts: list[list[int]], max_new: int, waves: int = 1
) -> dict[str, float]:
    """``waves`` groups of the prompts, one step apart (1: all together)."""
    record = Recorder()
    arrived: dict[str, float] = {}
    size = -(-len(prompts) // waves)
    for wave in range(waves):
        for i in range(wave * size, min(len(prompts), (wave + 1) * size)):
            arrived[f"b{i}"] = time.perf_counter() - record.t0
            _submit(engine, f"b{i}", prompts[i], max_new)
        record.step(engine)
    while engine.has_work():
        record.step(engine)
    ttft = [t[0] - arrived[rid] for rid, t in record.times.items()]
    gaps = [b - a for t in record.times.values() for a, b in itertools.pairwise(t)]
    makespan = max(t[-1] for t in record.times.values())
    tokens = sum(len(t) for t in record.times.values())
    tokens_per_s = tokens / makespan
    return {
        "tokens_per_cpu_s": round(tokens / (time.process_time() - record.cpu0), 1),
        "ttft_p50": _pct(ttft, 0.5), "ttft_p99": _pct(ttft, 0.99), "ttft_max": _pct(ttft, 1),
        "gap_p50": _pct(gaps, 0.5), "gap_p99": _pct(gaps, 0.99), "gap_max": _pct(gaps, 1),
        "tokens_per_s": round(tokens_per_s, 1),
    }


def decode_ceiling(
    loaded: LoadedModel, prompts: list[list[int]], steps: int = 8, rounds: int = 2
) -> tuple[float, float, float, float]:
    """Tokens/s of bare decode steps with every prompt running (32 / median step time),
    the median decode step and the median packed prefill of every prompt, in seconds,
    and the same ceiling in tokens per CPU second of this process.

    Also the run's warm-up: the first passes at each shape pay one-off costs."""
    times, prefills, cpu = [], [], []
    for _ in range(rounds):
        engine = Engine(loaded, max_batch=len(prompts), num_blocks=1024, max_prefill_tokens=4096)
        for i, ids in enumerate(prompts):
            _submit(engine, f"c{i}", ids, steps + 2)
        started = time.perf_counter()
        engine.step()  # every prefill, in one pass
        prefills.append(time.perf_counter() - started)
        for _ in range(steps):
            started, cpu_started = time.perf_counter(), time.process_time()
            engine.step()
            times.append(time.perf_counter() - started)
            cpu.append(time.process_time() - cpu_started)
        while engine.has_work():
            engine.step()
    step = statistics.median(times)
    cpu_ceiling = len(prompts) / statistics.median(cpu)
    return len(prompts) / step, step, statistics.median(prefills), cpu_ceiling


def long_prompt(
    engine: Engine, running: list[list[int]], long_ids: list[int], repeats: int = 2
) -> dict[str, Any]:
    """``repeats`` long prompts, one after another, among the running streams: the first
    meets the margin as calibrated, the next the margin its predecessor's steps left."""
    record = Recorder()
    for i, ids in enumerate(running):
        _submit(engine, f"r{i}", ids, 256)
    while len(record.times) < len(running):
        record.step(engine)
    for _ in range(2):
        record.step(engine)
    rounds = []
    for repeat in range(repeats):
        margin = engine.costs.margin()
        arrived = time.perf_counter() - record.t0
        name = f"long{repeat}"
        _submit(engine, name, long_ids, 2)
        while name not in record.times:
            record.step(engine)
        ttft = record.times[name][0] - arrived
        gaps = [
            b - a for rid, t in record.times.items() if rid.startswith("r")
            for a, b in itertools.pairwise(t) if arrived < b <= arrived + ttft
        ]
        rounds.append({"gap_p50": _pct(gaps, 0.5), "gap_p99": _pct(gaps, 0.99),
                       "gap_max": _pct(gaps, 1), "long_ttft": round(ttft * 1000, 1),
                       "margin_at_arrival": round(margin, 3)})
    for i in range(len(running)):
        engine.cancel(f"r{i}")
    while engine.has_work():
        engine.step()
    return {**rounds[0], "long_prompt_tokens": len(long_ids), "again": rounds[1:]}


def settings(loaded: LoadedModel, step_ms: float | None) -> dict[str, Options]:
    if step_ms is None:
        probe = Engine(loaded, max_batch=32, max_step_ms=1000.0)  # calibrates
        decode = probe.costs.decode_ms(32)
        assert decode is not None
        step_ms = round(2 * decode)
    return {
        "serial": {"pack_prefill": False},  # this bench's own option: see bench_engine
        "whole": {"max_prefill_tokens": 4096, "mixed_step": False},
        "budget-256": {"mixed_step": False},
        "budget-256-mixed": {},
        "step-target": {"max_prefill_tokens": 4096, "max_step_ms": step_ms, "mixed_step": False},
        "step-target-mixed": {"max_prefill_tokens": 4096, "max_step_ms": step_ms},
        # the same without counting a chunk's cached prefix (engine.costs.PREFIX_POSITIONS)
        "step-target-mixed-flat": {"max_prefill_tokens": 4096, "max_step_ms": step_ms,
                                   "prefix_positions": float("inf")},
    }


def bench_engine(loaded: LoadedModel, options: Options) -> Engine:
    """An engine of 32 slots and 1,024 blocks of 16 with a setting's engine options;
    ``pack_prefill=False`` (not an engine option: the exact mode) prefills a prompt a
    pass (``SerialPrefill``), and so without the mixed step."""
    options = dict(options)
    if not options.pop("pack_prefill", True):
        runner = SerialPrefill(ModelRunner(loaded, num_blocks=1024, block_size=16))
        options.update(runner=runner, mixed_step=False)
    return Engine(loaded, max_batch=32, num_blocks=1024, block_size=16, **options)


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--burst-tokens", type=int, default=16)
    parser.add_argument("--long-tokens", type=int, default=1000)
    parser.add_argument("--step-ms", type=float, default=None)
    parser.add_argument("--settings", nargs="+", default=None, help="a subset, by name")
    parser.add_argument("--scenarios", nargs="+", default=["burst", "waves", "long"])
    parser.add_argument("--ceiling-each", action="store_true",
                        help="measure the decode ceiling again before each setting")


@bench("burst", "a 32-prompt burst and a long prompt among running streams, per setting",
       arguments=arguments)
def run(args: argparse.Namespace) -> Report:
    loaded = load_model(args.model, "cpu")
    encode: Callable[[str], list[int]] = loaded.tokenizer.encode
    prompts = [encode(p) for p in load_prompts()]
    long_ids = [t for p in prompts for t in p][: args.long_tokens]
    ceiling, decode_s, prefill_s, cpu_ceiling = decode_ceiling(loaded, prompts)
    chosen = settings(loaded, args.step_ms)
    one = (prefill_s + decode_s) * 1000  # one packed prefill of all 32 plus one decode step
    head = {"decode_ceiling_tokens_per_s": round(ceiling, 1),
            "decode_ceiling_tokens_per_cpu_s": round(cpu_ceiling, 1),
            "decode_step_ms": round(decode_s * 1000, 1),
            "prefill_all_ms": round(prefill_s * 1000, 1),
            "step_target_ms": chosen["step-target"]["max_step_ms"]}
    rows = []
    for name, options in chosen.items():
        if args.settings and name not in args.settings:
            continue
        row: dict[str, Any] = {"setting": name, "options": options}
        if args.ceiling_each:  # the ceiling again, right before: a shared machine's load moves
            ceiling, decode_s, prefill_s, cpu_ceiling = decode_ceiling(loaded, prompts, rounds=1)
            one = (prefill_s + decode_s) * 1000
            row["ceiling"] = {"tokens_per_s": round(ceiling, 1),
                              "tokens_per_cpu_s": round(cpu_ceiling, 1),
                              "decode_step_ms": round(decode_s * 1000, 1),
                              "prefill_all_ms": round(prefill_s * 1000, 1)}
        options = dict(options)
        costs.PREFIX_POSITIONS = options.pop("prefix_positions", PREFIX_POSITIONS)
        for scenario in args.scenarios:
            engine = bench_engine(loaded, options)
            if scenario in ("burst", "waves"):
                got = burst(engine, prompts, args.burst_tokens, 1 if scenario == "burst" else 4)
                got["of_ceiling"] = round(got["tokens_per_s"] / ceiling, 3)
                got["of_ceiling_cpu"] = round(got["tokens_per_cpu_s"] / cpu_ceiling, 3)
                got["ttft_p99_of_one"] = round(got["ttft_p99"] / one, 2)
                row[scenario] = got
            else:
                row["long"] = long_prompt(engine, prompts[:16], long_ids)
        rows.append(row)
        print(json.dumps(row))
    summary = {"model": args.model, "burst_tokens": args.burst_tokens,
               "long_tokens": len(long_ids), **head}
    return Report(summary, {"rows": rows})
