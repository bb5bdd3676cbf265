"""Where a decode step's time goes, and what compiling the decode forward changes.

``python -m tools.bench overhead`` loads the embedded model once and, per batch size,
admits and prefills that many 32-token prompts in one engine, then times its decode
steps (issue 37 item 5):

* where an eager step's time goes: the costliest aten ops' shares under the torch
  profiler (``top_ops``), and the step's parts: building the batch metadata
  (``decode_batch``: block tables, slots, length groups), the forward pass (the model
  body and the output layer), sampling (``ModelRunner._sample``), recording each token
  (the detokenizer, the scheduler's bookkeeping), and the rest of ``step()``; each
  part's median ms;
* ``torch.compile`` (inductor) of the model for the decode pass beside the eager model,
  alternating step by step on the same engine (same cache, same sequences): the first
  compiled step's seconds (the compile), then each side's median step. ``--compile
  whole`` compiles the model with the paged attention inside the graph (a new length
  group count is a new graph); ``split`` registers the attention under a second name
  wrapped in ``torch.compiler.disable``, so dynamo compiles the pieces between the
  attention calls and the attention stays eager; ``none`` times eager only.

Both sides call the library's forward (the engine's own Llama pass,
``engine.llama_forward``, is set aside here; ``tools.bench onestream`` times it against the
library's). Compiled and eager steps share the engine, so they decode the same sequences; the
tokens of both are compared (``tokens_equal``: greedy argmax of the two sides' logits
on the same step). Set ``TORCHINDUCTOR_CACHE_DIR`` to time a warm (cached) compile.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from engine import model_runner
from engine.attention import ATTENTION_NAME, paged_attention
from engine.model import LoadedModel, load_model
from tools.bench.common import bench
from tools.bench.step import engine_stepper, prompt_ids
from tools.lab.common import Report

SPLIT_NAME = ATTENTION_NAME + "_eager"


def _timed(target: Any, name: str, into: dict[str, float], key: str | None = None) -> None:
    """Wrap ``target.name`` so that each call adds its seconds to ``into[key or name]``."""
    original = getattr(target, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            into[key or name] += time.perf_counter() - started

    setattr(target, name, wrapper)


def breakdown(loaded: LoadedModel, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    """Median ms per part of an eager decode step at ``batch`` rows."""
    engine = engine_stepper(loaded, prompt_ids(loaded, batch, args.prompt_tokens),
                            args.warmup + args.steps + args.profile_steps + 2)
    runner: Any = engine.runner  # the ModelRunner: its methods are wrapped and swapped
    runner.llama_pass = None  # the library's forward, whose body this breaks down
    spent: dict[str, float] = defaultdict(float)
    saved = model_runner.decode_batch
    _timed(model_runner, "decode_batch", spent)
    for target, name, key in ((runner, "forward", "forward"), (runner, "_sample", "_sample"),
                              (runner.model.model, "forward", "body"),
                              (engine.scheduler, "record_token", "record_token")):
        _timed(target, name, spent, key)
    parts: dict[str, list[float]] = defaultdict(list)
    try:
        for index in range(args.warmup + args.steps):
            spent.clear()
            started = time.perf_counter()
            engine.step()
            total = time.perf_counter() - started
            if index < args.warmup:
                continue
            body = spent.pop("forward", 0.0)
            layers = spent.pop("body", 0.0)
            figures = {"step": total, "forward": body, "model_body": layers,
                       "output_layer_etc": body - layers,
                       "batch_metadata": spent["decode_batch"], "sampling": spent["_sample"],
                       "record_tokens": spent["record_token"]}
            figures["rest_of_step"] = total - body - sum(
                spent[k] for k in ("decode_batch", "_sample", "record_token"))
            for key, value in figures.items():
                parts[key].append(value * 1000)
    finally:
        model_runner.decode_batch = saved
    result: dict[str, Any] = {key: round(statistics.median(values), 2)
                              for key, values in parts.items()}
    result["top_ops"] = top_ops(engine.step, args.profile_steps)
    with torch.inference_mode():
        logits = runner.decode_logits(engine.scheduler.schedule().decode)
    result.update(greedy_ms(logits))
    result["ours_share"] = round(
        (result["step"] - result["forward"]) / result["step"], 3)
    return result


def top_ops(step: Callable[[], object], steps: int, count: int = 8) -> dict[str, float]:
    """The share of the ops' own CPU time (torch profiler) of each of the ``count``
    costliest aten ops over ``steps`` steps, the ops' time per step in ms, and the
    profiled steps' wall time (what is not in an op: Python between them, and the
    profiler's own cost)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        started = time.perf_counter()
        for _ in range(steps):
            step()
        wall = time.perf_counter() - started
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in events)
    shares = {e.key: round(e.self_cpu_time_total / total, 3) for e in events[:count]}
    shares["ops_ms_per_step"] = round(total / 1000 / steps, 2)
    shares["profiled_wall_ms_per_step"] = round(wall * 1000 / steps, 2)
    return shares


def greedy_ms(logits: torch.Tensor, repeats: int = 30) -> dict[str, float]:
    """Median ms of the greedy pick over a step's logits: ``argmax`` (the pick before)
    against ``max(dim).indices`` (``sampling.greedy``), alternated."""
    times: dict[str, list[float]] = {"greedy_argmax_ms": [], "greedy_max_ms": []}
    for _ in range(repeats):
        for key, pick in (("greedy_argmax_ms", lambda: logits.argmax(dim=-1)),
                          ("greedy_max_ms", lambda: logits.max(dim=-1).indices)):
            started = time.perf_counter()
            pick()
            times[key].append((time.perf_counter() - started) * 1000)
    return {key: round(statistics.median(values), 3) for key, values in times.items()}


def compiled_model(loaded: LoadedModel, how: str) -> torch.nn.Module:
    """The model compiled for decode passes (``how``: whole or split)."""
    model = loaded.model
    if how == "split":
        from transformers import AttentionInterface

        AttentionInterface.register(
            SPLIT_NAME, torch.compiler.disable(paged_attention))
        model = copy.deepcopy(model)
        model.set_attn_implementation(SPLIT_NAME)
    return torch.compile(model, dynamic=True)  # type: ignore[return-value]


def side_by_side(loaded: LoadedModel, compiled: torch.nn.Module, batch: int,
                 args: argparse.Namespace) -> dict[str, Any]:
    """The first compiled step's seconds, then compiled and eager steps alternated."""
    steps = args.warmup + args.steps
    engine = engine_stepper(loaded, prompt_ids(loaded, batch, args.prompt_tokens), 2 * steps + 2)
    runner: Any = engine.runner  # the ModelRunner: its methods are wrapped and swapped
    runner.llama_pass = None  # the library's forward, eager against compiled
    eager = runner.model
    logits: dict[str, torch.Tensor] = {}
    forward = runner.forward

    def keeping(side: str) -> Callable[..., torch.Tensor]:
        def call(*a: Any, **k: Any) -> torch.Tensor:
            out = forward(*a, **k)
            logits[side] = out
            return out
        return call

    runner.model = compiled
    started = time.perf_counter()
    engine.step()
    first_s = time.perf_counter() - started
    times: dict[str, list[float]] = {"compiled": [], "eager": []}
    try:
        for index in range(steps):
            for side, model in (("compiled", compiled), ("eager", eager)):
                runner.model = model
                runner.forward = keeping(side)
                started = time.perf_counter()
                engine.step()
                if index >= args.warmup:
                    times[side].append((time.perf_counter() - started) * 1000)
    finally:
        runner.model, runner.forward = eager, forward
    # The last two steps decoded different positions; compare one step's logits instead.
    with torch.inference_mode():
        seqs = engine.scheduler.schedule().decode  # gives every row its next block
        runner.model = compiled
        a = runner.decode_logits(seqs)
        runner.model = eager
        b = runner.decode_logits(seqs)
    equal = bool(torch.equal(a.argmax(-1), b.argmax(-1)))
    compiled_ms = statistics.median(times["compiled"])
    eager_ms = statistics.median(times["eager"])
    return {"batch": batch, "first_compiled_step_s": round(first_s, 1),
            "compiled_ms": round(compiled_ms, 2), "eager_ms": round(eager_ms, 2),
            "ratio": round(compiled_ms / eager_ms, 3), "tokens_equal": equal,
            "max_abs_logit_diff": round(float((a - b).abs().max()), 6)}


def side_by_side_arguments(parser: argparse.ArgumentParser) -> None:
    """The options ``side_by_side`` reads (this bench's and ``int8compile``'s)."""
    parser.add_argument("--device", default=None)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--steps", type=int, default=12, help="timed decode steps per side")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=32)


def arguments(parser: argparse.ArgumentParser) -> None:
    side_by_side_arguments(parser)
    parser.add_argument("--profile-steps", type=int, default=3, help="steps under the profiler")
    parser.add_argument("--compile", choices=("none", "whole", "split"), default="split")


@bench("overhead", "a decode step's parts, and torch.compile of the decode forward beside eager",
       arguments=arguments)
def run(args: argparse.Namespace) -> Report:
    loaded = load_model(args.model, args.device, precision=args.precision)
    engine_stepper(loaded, prompt_ids(loaded, 2, args.prompt_tokens), 4).step()  # one-off costs
    parts = {str(b): breakdown(loaded, b, args) for b in args.batches}
    rows = []
    if args.compile != "none":
        compiled = compiled_model(loaded, args.compile)
        rows = [side_by_side(loaded, compiled, b, args) for b in args.batches]
    summary: dict[str, Any] = {
        "model": args.model, "precision": loaded.precision, "threads": torch.get_num_threads(),
        "compile": args.compile,
        "eager_step_ms": {b: p["step"] for b, p in parts.items()},
        "ours_share": {b: p["ours_share"] for b, p in parts.items()},
        "greedy_max_over_argmax": {b: round(p["greedy_max_ms"] / p["greedy_argmax_ms"], 3)
                                   for b, p in parts.items()},
    }
    for row in rows:
        summary[f"compiled_over_eager_b{row['batch']}"] = row["ratio"]
        summary[f"first_compiled_step_s_b{row['batch']}"] = row["first_compiled_step_s"]
        summary[f"tokens_equal_b{row['batch']}"] = row["tokens_equal"]
    return Report(summary, {"breakdown": parts, "compiled": rows})
