"""A decode step's linear layers per precision, timed in turn: what ``auto`` is chosen by.

``python -m tools.bench linears [--precisions ...] [--batches 1 8 32] [--reps 10]``
loads the embedded model once per precision (``engine.precision``: each one's layers as
the engine runs them, calibrated on this CPU) and times, at each row count, one pass of
every linear layer of the model (SmolLM2-135M: the 210 layers and the output layer) on
random rows, as one decode step runs them. The precisions take turns rep by rep (float32,
bfloat16, int8, int4, float32, ...), so that a busy machine's load falls on all of them
alike; the summary is each one's median ms per row count (and least: on a busy machine
nearer the kernels' own), which precision is fastest at each (by the median), and each
shape's calibrated rows per call. It leaves out what is the same in every
precision (attention, norms, sampling): ``tools.bench step`` times whole steps.

Issue 44's figures (a 2-core AMD EPYC, its own probe script) are this measurement; the
project's (an Intel Xeon with AMX) are in docs/results.md, "int4".
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from engine.batch_invariance import shape_key
from engine.cpu_linear import _RowWise
from engine.fused_projections import JOINS
from engine.model import load_model
from engine.precision import PRECISIONS
from tools.bench.common import bench
from tools.lab.common import Report


def layers_of(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's linear layers as the engine runs them (float32's are ``nn.Linear``;
    where projections are joined, ``engine.fused_projections``, the joined layer and not
    its parts)."""
    joined_parts = {id(getattr(holder, part)) for holder in model.modules()
                    for _, parts, joined in JOINS if hasattr(holder, joined)
                    for part in parts}
    return [m for m in model.modules() if id(m) not in joined_parts and (
        isinstance(m, (_RowWise, torch.nn.Linear)) or type(m).__name__ == "Conv1D")]


def one_step(layers: list[torch.nn.Module], rows: dict[int, torch.Tensor]) -> float:
    """Seconds for every layer once on ``rows`` (by input width)."""
    started = time.perf_counter()
    for layer in layers:
        layer(rows[width(layer)])
    return time.perf_counter() - started


def width(layer: torch.nn.Module) -> int:
    """A layer's input width (GPT-2's ``Conv1D`` keeps its weight as (in, out))."""
    if isinstance(layer, (_RowWise, torch.nn.Linear)):
        return int(layer.in_features)
    weight = layer.weight
    assert isinstance(weight, torch.Tensor)
    return int(weight.shape[0])


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--reps", type=int, default=10, help="timed passes per precision")


@bench("linears", "a decode step's linear layers per precision, in turns (auto's choice)",
       arguments=arguments)
def run(args: argparse.Namespace) -> Report:
    models = {p: load_model(args.model, precision=p).model for p in args.precisions}
    layers = {p: layers_of(m) for p, m in models.items()}
    dtype = {p: next(m.parameters()).dtype for p, m in models.items()}
    raw: dict[str, Any] = {}
    medians: dict[str, dict[str, float]] = {p: {} for p in args.precisions}
    least: dict[str, dict[str, float]] = {p: {} for p in args.precisions}
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for batch in args.batches:
            widths = {width(layer) for ls in layers.values() for layer in ls}
            base = {w: torch.randn(batch, w, generator=generator) for w in widths}
            rows = {p: {w: x.to(dtype[p]) for w, x in base.items()} for p in args.precisions}
            times: dict[str, list[float]] = {p: [] for p in args.precisions}
            for rep in range(args.reps + 2):  # two untimed rounds first
                for p in args.precisions:
                    seconds = one_step(layers[p], rows[p])
                    if rep >= 2:
                        times[p].append(seconds * 1000)
            for p in args.precisions:
                medians[p][str(batch)] = round(statistics.median(times[p]), 2)
                least[p][str(batch)] = round(min(times[p]), 2)
            raw[str(batch)] = {p: [round(t, 2) for t in ts] for p, ts in times.items()}
    fastest = {str(b): min(args.precisions, key=lambda p: medians[p][str(b)])
               for b in args.batches}
    rows_per_call = {p: {f"{k} {i}->{o}": m.rows_per_call for m in ls if isinstance(m, _RowWise)
                         for k, o, i in [shape_key(m)]} for p, ls in layers.items()}
    summary = {"model": args.model, "threads": torch.get_num_threads(),
               "layers": {p: len(ls) for p, ls in layers.items()},
               "ms_by_precision_and_rows": medians, "fastest_by_rows": fastest,
               # on a busy machine the least time is nearer the kernels' own
               "least_ms_by_precision_and_rows": least,
               "rows_per_call": rows_per_call}
    return Report(summary, {"ms_each_rep": raw})
