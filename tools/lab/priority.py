"""``priority``: an interactive band beside a flex flood, and two tenants sharing a band.

Issue 48, at the engine level, in-process (``engine.Engine``, stepped in a worker thread
of this process; the lab's server it starts only idles)::

    nice -n 15 python -m tools.lab priority            # smollm2 (the embedded model)
    python -m tools.lab priority --quick               # tiny-gpt2, seconds

In the server's default precision (``--precision auto``: int4 on a CPU with AMX; the
summary's ``precision`` says which), float32 under ``--quick``.

Arrivals are scheduled by step, so every condition sees the same traffic; times are the
wall clock around the steps (``time.perf_counter``). Conditions, each on a fresh engine
(``--batch`` slots, default 8):

* ``idle``: the interactive requests alone (band 0, tenant "interactive": short prompts,
  ``--answer`` tokens), one arriving every ``--every`` steps;
* ``flood``: the flood alone (band 2, flex, tenant "flood": long prompts, long answers,
  ``--flood`` streams, more than the batch holds, kept up closed loop: a finished flood
  stream is replaced), for the same number of steps;
* ``mixed``: both at once. Interactive TTFT (submit to first token) and inter-token gap,
  p95, against ``idle``'s. ``flood`` and ``mixed`` run half as many steps again after
  the last interactive arrival (a lull); the flood's tokens/s over mixed's steps in which
  no interactive request was in the engine, against ``flood``'s over the same steps
  (``flood_idle_share``: those steps are mixed's first few, the flood's prompts
  prefilling in both, and the lull, in which mixed's flood recomputes the streams
  preempted for the interactive band while the flood alone runs on: what the interactive
  key costs the flood once it is idle);
* ``fair``: two tenants in one band, closed loop, "long" (long prompts and answers) and
  "short" (short ones), each keeping ``--batch`` streams in the engine: each one's served
  work per second (prompt tokens computed + decode tokens, the decode weighted as the
  engine's cost model weighs it: ``FairShare.decode_weight``) while both had work
  waiting, and Jain's index over the two; ``fair_fcfs`` is the same traffic with both
  in one tenant, first come first served, for comparison;
* ``starved``: the floor of progress (``engine.aging``): the interactive band closed
  loop with more streams than the batch holds (``--batch`` + 2, ``--answer`` tokens), so
  strictly a lower band would never be admitted, and one flex stream submitted at step
  0: ``longest_low_wait_steps`` is the most steps a flex sequence waited in the queue
  (admitted, or still waiting when the condition ended), against ``aging_bound_steps``
  (one band above it: a period, ``--aging`` steps, plus an interactive answer for a slot
  to free); ``low_admitted`` whether it got its first token within the condition.

Then every flood stream of ``mixed`` that was preempted by priority and ended within
the condition (at most ``--compare``; the drain cancels the others) runs again alone:
its text must equal (``preempted_identical``); half of the flood is greedy and half
seeded. After each condition the engine is drained and its cache must be whole
(``leaked_blocks``: blocks not free, summed).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import trio

from engine import FinishEvent, GenerationRequest, SamplingParams, TokenEvent
from engine.aging import PRIORITY_AGING_STEPS, Aging
from engine.engine import Engine
from engine.model import load_model
from tools.lab.common import Lab, Report, experiment, pct

INTERACTIVE, FLEX = 0, 2  # bands: vLLM's priority, lower is sooner


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, default=None, help="batch slots (8; quick 4)")
    parser.add_argument("--flood", type=int, default=None, help="flood streams (12; quick 6)")
    parser.add_argument("--steps", type=int, default=None, help="steps a condition (300)")
    parser.add_argument("--every", type=int, default=None, help="interactive arrival (12)")
    parser.add_argument("--answer", type=int, default=None, help="interactive tokens (16)")
    parser.add_argument("--compare", type=int, default=None, help="preempted re-run (8)")
    parser.add_argument("--long-answer", type=int, default=None,
                        help="flood and long tenant's answer tokens (96; quick 24)")
    parser.add_argument("--precision", default=None,
                        help="the weights' precision (engine.precision; auto, the server's "
                             "default on this CPU; quick float32)")
    parser.add_argument("--aging", type=int, default=None,
                        help=f"aging period in steps ({PRIORITY_AGING_STEPS}; quick 20)")


@dataclass
class Traffic:
    """What one condition sends: arrivals by step, kept-up tenants, lengths."""

    interactive: list[tuple[int, GenerationRequest]] = field(default_factory=list)
    loops: dict[str, tuple[int, list[GenerationRequest]]] = field(default_factory=dict)


@dataclass
class Outcome:
    ttft: list[float] = field(default_factory=list)  # interactive, s
    gaps: list[float] = field(default_factory=list)  # interactive, s
    flood_tokens_quiet: int = 0  # flood tokens made in steps with no interactive in
    quiet_s: float = 0.0
    quiet_steps: list[int] = field(default_factory=list)  # those steps' indices
    flood_steps: list[tuple[int, float]] = field(default_factory=list)  # (tokens, s) a step
    served: dict[str, float] = field(default_factory=dict)  # work while all backlogged
    both_s: float = 0.0
    texts: dict[str, str] = field(default_factory=dict)
    requests: dict[str, GenerationRequest] = field(default_factory=dict)
    preempted: set[str] = field(default_factory=set)
    finished: set[str] = field(default_factory=set)  # ended in the condition (not drained)
    priority_preemptions: int = 0
    leaked_blocks: int = 0
    steps: int = 0
    longest_wait_steps: dict[int, int] = field(default_factory=dict)  # by band, see _run


@experiment("priority", "an interactive band beside a flex flood (TTFT and gaps against "
            "idle, the flood's rate), two tenants' fair shares by work (Jain), preempted "
            "streams against their solo runs", server={"model": "tiny-gpt2"},
            arguments=arguments)
async def priority(lab: Lab) -> Report:
    args = lab.args
    model = args.model or lab.pick("smollm2", "tiny-gpt2")
    if args.threads:
        torch.set_num_threads(args.threads)
    size = {"batch": lab.option("batch", 8, 4), "flood": lab.option("flood", 12, 6),
            "steps": lab.option("steps", 300, 60), "every": lab.option("every", 12, 6),
            "answer": lab.option("answer", 16, 6), "compare": lab.option("compare", 8, 3),
            "long_prompt": lab.pick(6, 2), "long_answer": lab.option("long_answer", 96, 24),
            "short_answer": lab.pick(16, 6),
            "aging": lab.option("aging", PRIORITY_AGING_STEPS, 20),
            "precision": args.precision or lab.pick("auto", "float32")}
    return await trio.to_thread.run_sync(_run_all, lab, model, size)


def _run_all(lab: Lab, model: str, size: dict[str, Any]) -> Report:
    loaded = load_model(model, "cpu", precision=size["precision"])
    size["precision"] = loaded.precision  # what auto chose, in the summary
    prompts = lab.prompts(32)
    long_prompt = [" ".join(prompts[i:i + size["long_prompt"]]) for i in range(16)]
    options = {"max_batch": size["batch"], "num_blocks": 4096, "block_size": 16}

    def engine() -> Engine:
        made = Engine(loaded, **options)
        made.scheduler.residency.aging = Aging(size["aging"])
        return made

    def flood_request(i: int, tenant: str = "flood", band: int = FLEX) -> GenerationRequest:
        seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=100 + i, ignore_eos=True)
        sampling = seeded if i % 2 else SamplingParams(ignore_eos=True)
        return GenerationRequest(f"{tenant}{i}", long_prompt[i % 16], size["long_answer"],
                                 sampling=sampling, priority=band, tenant=tenant)

    interactive = [(5 + k * size["every"], GenerationRequest(
        f"int{k}", prompts[k % 32], size["answer"], sampling=SamplingParams(ignore_eos=True),
        priority=INTERACTIVE, tenant="interactive"))
        for k in range(max((size["steps"] - 20) // size["every"], 1))]
    flood = [flood_request(i) for i in range(size["flood"] * 8)]
    steps = size["steps"]
    _run(engine(), Traffic(interactive=[(0, interactive[0][1])]), 0)  # warm up: not counted
    idle = _run(engine(), Traffic(interactive=interactive), steps)
    # The flood alone and mixed run a lull of steps // 2 more after the interactive
    # arrivals end: the steps the flood has the engine to itself again (its share there).
    alone = _run(engine(), Traffic(loops={"flood": (size["flood"], flood)}), steps * 3 // 2)
    mixed = _run(engine(), Traffic(interactive=interactive,
                                   loops={"flood": (size["flood"], flood)}), steps * 3 // 2)

    def pair(one_tenant: bool) -> Traffic:
        def tenant(name: str) -> str:
            return "both" if one_tenant else name
        long = [GenerationRequest(f"long{i}", long_prompt[i % 16], size["long_answer"],
                                  sampling=SamplingParams(ignore_eos=True), priority=FLEX,
                                  tenant=tenant("long")) for i in range(size["batch"] * 40)]
        short = [GenerationRequest(f"short{i}", prompts[i % 32], size["short_answer"],
                                   sampling=SamplingParams(ignore_eos=True), priority=FLEX,
                                   tenant=tenant("short")) for i in range(size["batch"] * 40)]
        return Traffic(loops={"long": (size["batch"], long), "short": (size["batch"], short)})

    fair = _run(engine(), pair(False), steps)
    fcfs = _run(engine(), pair(True), steps)
    high = [GenerationRequest(f"high{i}", prompts[i % 32], size["answer"],
                              sampling=SamplingParams(ignore_eos=True), priority=INTERACTIVE,
                              tenant="interactive") for i in range(steps * 2)]
    starved = _run(engine(), Traffic(interactive=[(0, flood_request(0, "low"))],
                                     loops={"high": (size["batch"] + 2, high)}), steps)
    identical, compared = 0, sorted(mixed.preempted & mixed.finished)[: size["compare"]]
    for rid in compared:  # whole answers only (the drain cancels the rest)
        solo = _run(engine(), Traffic(interactive=[(0, mixed.requests[rid])]), 0)
        identical += solo.texts[rid] == mixed.texts.get(rid)
    summary = _summary(model, size, idle, alone, mixed, fair, fcfs)
    summary.update(preempted_compared=len(compared), preempted_identical=identical,
                   aging_steps=size["aging"], aging_bound_steps=size["aging"] + size["answer"],
                   longest_low_wait_steps=starved.longest_wait_steps.get(FLEX),
                   low_admitted=bool(starved.ttft), leaked_blocks_starved=starved.leaked_blocks)
    raw = {name: {"ttft_s": o.ttft, "steps": o.steps, "served": o.served,
                  "preempted": sorted(o.preempted)}
           for name, o in (("idle", idle), ("flood", alone), ("mixed", mixed),
                           ("fair", fair), ("fair_fcfs", fcfs), ("starved", starved))}
    return Report(summary=summary, raw=raw)


def _summary(model: str, size: dict[str, Any], idle: Outcome, alone: Outcome, mixed: Outcome,
             fair: Outcome, fcfs: Outcome) -> dict[str, Any]:
    def ms(values: list[float], q: float) -> float | None:
        at = pct(values, q)
        return None if at is None else round(at * 1000, 1)

    def rate(o: Outcome) -> float | None:
        return round(o.flood_tokens_quiet / o.quiet_s, 1) if o.quiet_s else None

    out: dict[str, Any] = {"model": model, **{k: size[k] for k in
                                              ("precision", "batch", "flood", "steps")}}
    for name, o in (("idle", idle), ("mixed", mixed)):
        out[f"ttft_p95_{name}"] = ms(o.ttft, 95)
        out[f"gap_p95_{name}"] = ms(o.gaps, 95)
    out["ttft_ratio"] = _ratio(out["ttft_p95_mixed"], out["ttft_p95_idle"])
    out["gap_ratio"] = _ratio(out["gap_p95_mixed"], out["gap_p95_idle"])
    # The quiet steps of mixed are few and not typical (its first steps, the flood's
    # prompts prefilling, and the tail after the last interactive answer, the flood
    # recomputing its preempted streams), so the flood alone is taken over the same steps.
    out["quiet_steps_mixed"] = len(mixed.quiet_steps)
    out["flood_tokens_per_s_alone"] = rate(alone)
    out["flood_tokens_per_s_alone_same_steps"] = _rate_over(alone, mixed.quiet_steps)
    out["flood_tokens_per_s_quiet_mixed"] = rate(mixed)
    out["flood_idle_share"] = _ratio(rate(mixed), out["flood_tokens_per_s_alone_same_steps"])
    out["priority_preemptions_mixed"] = mixed.priority_preemptions
    for name, o in (("fair", fair), ("fair_fcfs", fcfs)):
        per_s = [w / o.both_s for w in o.served.values()] if o.both_s else []
        out[f"jain_{name}"] = _jain(per_s)
        out[f"work_per_s_{name}"] = {t: round(w / o.both_s, 1) for t, w in o.served.items()
                                     } if o.both_s else {}
    out["leaked_blocks"] = sum(o.leaked_blocks for o in (idle, alone, mixed, fair, fcfs))
    return out


def _rate_over(o: Outcome, steps: list[int]) -> float | None:
    """The flood's tokens/s of ``o`` over the steps ``steps`` (indices)."""
    chosen = [o.flood_steps[i] for i in steps if i < len(o.flood_steps)]
    seconds = sum(s for _, s in chosen)
    return round(sum(n for n, _ in chosen) / seconds, 1) if seconds else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 3)


def _jain(values: list[float]) -> float | None:
    """Jain's fairness index: (sum x)^2 / (n sum x^2), 1 when all are equal."""
    squares = sum(v * v for v in values)
    return round(sum(values) ** 2 / (len(values) * squares), 4) if squares else None


def _run(engine: Engine, traffic: Traffic, steps: int) -> Outcome:
    """Step ``engine`` ``steps`` times (or, with no closed loop, until the interactive
    requests are done), submitting as scheduled; then drain it and count its leak."""
    out = Outcome()
    pending = sorted(traffic.interactive, key=lambda a: a[0])
    loops = {t: (n, list(reqs)) for t, (n, reqs) in traffic.loops.items()}
    live: dict[str, str] = {}  # request id -> tenant, loop streams in the engine
    submitted: dict[str, float] = {}
    last: dict[str, float] = {}
    prompt_len: dict[str, int] = {}  # loop streams' prompt tokens (no prefix cache)
    for tenant, (n, reqs) in loops.items():
        for _ in range(n):
            _submit(engine, reqs.pop(0), out, live, tenant, prompt_len)
    step = 0
    while step < steps or (not loops and (pending or engine.has_work())):
        while pending and pending[0][0] <= step:
            request = pending.pop(0)[1]
            engine.submit(request)
            out.requests[request.request_id] = request
            submitted[request.request_id] = time.perf_counter()
        quiet = not any(r in submitted for r in _in_engine(engine)) and not (
            pending and pending[0][0] <= step)
        backlogged = bool(loops) and all(
            any(live.get(s.request_id) == t for s in engine.scheduler.waiting) for t in loops)
        t0 = time.perf_counter()
        events = engine.step()
        now = time.perf_counter()
        step += 1
        out.preempted.update(s.request_id for s in (*engine.scheduler.waiting,
                                                   *engine.scheduler.running.values())
                             if s.num_priority_preemptions)
        flood_tokens = 0
        work = dict.fromkeys(loops, 0.0)
        for event in events:
            rid = event.request_id
            if isinstance(event, TokenEvent):
                out.texts[rid] = out.texts.get(rid, "") + event.text
                if rid in submitted:
                    at = submitted[rid] if event.index == 0 else last[rid]
                    (out.ttft if event.index == 0 else out.gaps).append(now - at)
                    last[rid] = now
                elif rid in live:
                    flood_tokens += 1
                    work[live[rid]] += (engine.scheduler.residency.fair.decode_weight
                                        if event.index else prompt_len[rid])
            elif isinstance(event, FinishEvent):
                out.finished.add(rid)
                if rid not in live:
                    continue
                tenant = live.pop(rid)
                if step < steps and loops[tenant][1]:
                    _submit(engine, loops[tenant][1].pop(0), out, live, tenant, prompt_len)
        out.flood_steps.append((flood_tokens, now - t0))
        if quiet:
            out.quiet_steps.append(step - 1)
            out.flood_tokens_quiet += flood_tokens
            out.quiet_s += now - t0
        if backlogged:  # the work of a step that began with both waiting
            out.both_s += now - t0
            for tenant, done in work.items():
                out.served[tenant] = out.served.get(tenant, 0.0) + done
    out.steps = step
    stats = engine.statistics()
    out.priority_preemptions = stats.priority_preemptions
    # The most steps a sequence of each band waited in the queue: admitted (the engine's
    # count), or still waiting now (a lower bound of its wait).
    out.longest_wait_steps = dict(engine.scheduler.residency.bands.longest_wait_steps)
    now = engine.scheduler.residency.aging.steps
    for seq in engine.scheduler.waiting:
        band = seq.request.priority
        out.longest_wait_steps[band] = max(out.longest_wait_steps.get(band, 0),
                                           now - seq.entered_queue_step)
    for rid in list(live):
        engine.cancel(rid)
    while engine.has_work():
        engine.step()
    engine.step()
    stats = engine.statistics()
    out.leaked_blocks = stats.blocks_total - stats.blocks_free + stats.admitted - stats.releases
    return out


def _submit(engine: Engine, request: GenerationRequest, out: Outcome, live: dict[str, str],
            tenant: str, prompt_len: dict[str, int]) -> None:
    prompt_len[request.request_id] = len(engine.tokenize(request.prompt))
    engine.submit(request)
    out.requests[request.request_id] = request
    live[request.request_id] = tenant


def _in_engine(engine: Engine) -> list[str]:
    scheduler = engine.scheduler
    return [s.request_id for s in (*scheduler.waiting, *scheduler.running.values())]
