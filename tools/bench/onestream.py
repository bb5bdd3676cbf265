"""Where one stream's decode step goes, and the engine's Llama pass against the library's.

``python -m tools.bench onestream --precision int4 --threads 2`` loads the model once,
admits and prefills ``--batches`` rows (default one: a single conversation), and times
decode steps of one engine alternately (issue 44's one-stream target):

* ``library``: the model called through transformers' ``LlamaForCausalLM`` forward
  (the engine's path before ``engine.llama_forward``), its separate projections;
* ``python_layers``: the engine's own pass (``engine.llama_forward.LlamaPass``: the same
  ops with fewer calls, the joined int4 projections of ``engine.fused_projections``), its
  decoder layers in Python;
* ``engine``: the same pass as the engine runs it, a decode's layers compiled where
  ``engine.llama_decode`` applies (joined int4 layers, one read group), else as above.

The sides decode the same sequences on the same cache, taking turns step after step, so
a shared machine's load falls on each alike; each side's median and least step, and
their ratios. Then, on the ``python_layers`` side (the compiled layers have no Python
parts to time), where the step's time goes: the linear layers (the
int4/bfloat16 body layers, the output layer), the attention (the paged cache's writes,
gathers and kernel), the rest of the forward pass (norms, rotary, residuals, the
Python between), and the step outside the forward (batch metadata, sampling, the
scheduler): each part's median over the timed steps.

``--profile`` adds the ``engine`` side's steps as torch's profiler sees them (the
compiled layers' operators included, which the part timers cannot reach): each operator's
own time per step, the largest first (``profile_ms_per_step``; the profiler's own cost is
in them too, so read them as shares of ``profile_step_ms``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from engine import llama_forward
from engine.cpu_linear import _RowWise
from engine.model import load_model
from tools.bench.common import bench
from tools.bench.step import engine_stepper, prompt_ids
from tools.lab.common import Report


def _timing(spent: dict[str, float], key: str, call: Callable[..., Any]) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            spent[key] += time.perf_counter() - started

    return timed


SIDES = ("library", "python_layers", "engine")


def alternate(runner: Any, step: Callable[[], object], steps: int, warmup: int
              ) -> dict[str, list[float]]:
    """Step ms of each side (``SIDES``), the sides taking turns step by step."""
    lean = runner.llama_pass
    times: dict[str, list[float]] = {side: [] for side in SIDES}
    try:
        for index in range(len(SIDES) * (warmup + steps)):
            side = SIDES[index % len(SIDES)]
            runner.llama_pass = None if side == "library" else lean
            lean.use_scripted = side == "engine"
            started = time.perf_counter()
            step()
            if index >= len(SIDES) * warmup:
                times[side].append((time.perf_counter() - started) * 1000)
    finally:
        runner.llama_pass = lean
        lean.use_scripted = True
    return times


def parts(runner: Any, step: Callable[[], object], steps: int) -> dict[str, float]:
    """Median ms of each part of the engine's step (the module docstring)."""
    spent: dict[str, float] = defaultdict(float)
    head = runner.model.get_output_embeddings()
    originals: list[tuple[Any, str, Any]] = []

    def wrap(target: Any, name: str, key: str) -> None:
        originals.append((target, name, vars(target).get(name)))
        setattr(target, name, _timing(spent, key, getattr(target, name)))

    for module in runner.model.modules():
        if isinstance(module, _RowWise):
            wrap(module, "_call", "output_layer" if module is head else "body_linears")
    wrap(llama_forward, "paged_attention", "attention")
    wrap(runner, "forward", "forward")
    figures: dict[str, list[float]] = defaultdict(list)
    runner.llama_pass.use_scripted = False  # the Python layers: their parts can be timed
    try:
        for _ in range(steps):
            spent.clear()
            started = time.perf_counter()
            step()
            total = time.perf_counter() - started
            inside = spent["body_linears"] + spent["output_layer"] + spent["attention"]
            for key, value in (("step", total), ("forward", spent["forward"]),
                               ("body_linears", spent["body_linears"]),
                               ("output_layer", spent["output_layer"]),
                               ("attention", spent["attention"]),
                               ("rest_of_forward", spent["forward"] - inside),
                               ("outside_forward", total - spent["forward"])):
                figures[key].append(value * 1000)
    finally:
        runner.llama_pass.use_scripted = True
        for target, name, original in reversed(originals):
            if original is None:  # it was the class's: drop the instance's wrapper
                delattr(target, name)
            else:
                setattr(target, name, original)
    return {key: round(statistics.median(values), 2) for key, values in figures.items()}


PROFILED_OPS = 12  # the operators ``--profile`` reports, by their own time


def profile(runner: Any, step: Callable[[], object], steps: int) -> dict[str, Any]:
    """The ``engine`` side's ``steps`` steps under torch's profiler: each operator's own
    milliseconds per step (``PROFILED_OPS`` of them), and the steps' mean."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    runner.llama_pass.use_scripted = True
    with torch_profile(activities=[ProfilerActivity.CPU]) as profiled:
        started = time.perf_counter()
        for _ in range(steps):
            step()
        step_ms = (time.perf_counter() - started) * 1000 / steps
    events = sorted(profiled.key_averages(), key=lambda e: -e.self_cpu_time_total)
    return {"profile_step_ms": round(step_ms, 2),
            "profile_ms_per_step": {e.key: round(e.self_cpu_time_total / 1000 / steps, 3)
                                    for e in events[:PROFILED_OPS]},
            "profile_calls_per_step": {e.key: e.count // steps for e in events[:PROFILED_OPS]}}


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batches", type=int, nargs="+", default=[1])
    parser.add_argument("--steps", type=int, default=40, help="timed decode steps per side")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--profile", action="store_true",
                        help="also the engine side's operators under torch's profiler")


@bench("onestream", "a one-stream decode step: the engine's Llama pass against the "
       "library's forward, and its parts", arguments=arguments)
def run(args: argparse.Namespace) -> Report:
    loaded = load_model(args.model, "cpu", precision=args.precision)
    rows: list[dict[str, Any]] = []
    for batch in args.batches:
        steps = (len(SIDES) * (args.warmup + args.steps) + args.steps
                 + (args.steps if args.profile else 0))
        engine = engine_stepper(loaded, prompt_ids(loaded, batch, args.prompt_tokens), steps)
        runner: Any = engine.runner
        if runner.llama_pass is None:
            raise SystemExit(f"{args.model} is not a Llama model: no engine pass to compare")
        times = alternate(runner, engine.step, args.steps, args.warmup)
        row: dict[str, Any] = {"batch": batch}
        for side, values in times.items():
            row[f"{side}_ms"] = round(statistics.median(values), 2)
            row[f"{side}_least_ms"] = round(min(values), 2)
        row["engine_over_library"] = round(row["engine_ms"] / row["library_ms"], 3)
        row["engine_over_python_layers"] = round(row["engine_ms"] / row["python_layers_ms"], 3)
        row["engine_parts_ms"] = parts(runner, engine.step, args.steps)
        if args.profile:
            row.update(profile(runner, engine.step, args.steps))
        rows.append(row)
    summary = {
        "model": args.model, "precision": loaded.precision,
        "engine_ms_by_batch": {str(r["batch"]): r["engine_ms"] for r in rows},
        "library_ms_by_batch": {str(r["batch"]): r["library_ms"] for r in rows},
        "python_layers_ms_by_batch": {str(r["batch"]): r["python_layers_ms"] for r in rows},
        "engine_over_library": {str(r["batch"]): r["engine_over_library"] for r in rows},
        "engine_over_python_layers": {str(r["batch"]): r["engine_over_python_layers"]
                                      for r in rows},
        "engine_parts_ms": {str(r["batch"]): r["engine_parts_ms"] for r in rows},
    }
    if args.profile:
        summary["profile_ms_per_step"] = {str(r["batch"]): r["profile_ms_per_step"]
                                          for r in rows}
        summary["profile_step_ms"] = {str(r["batch"]): r["profile_step_ms"] for r in rows}
    return Report(summary, {"rows": rows})
