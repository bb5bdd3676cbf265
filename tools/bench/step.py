"""Median time of one decode step: the engine against plain transformers.

``python -m tools.bench step`` loads the embedded model once and,
for each batch size B, times decode steps (no prefill in them) of

* the engine: B sequences admitted together, then ``step()`` decoding all B
  over the paged cache (sampling and detokenizing included);
* plain transformers: the same B prompts at the same context, one batched
  forward with the library's own KV cache (``DynamicCache``, sdpa attention)
  and a greedy argmax.

The two sides alternate step by step (engine, plain, engine, plain, ...) on two
copies of the same weights, so both see the same noise on a shared machine and
their ratio is fair. Prompts are cut to the same token length so that neither
side needs padding.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from tqdm import tqdm
from transformers import DynamicCache, PreTrainedModel

from engine import GenerationRequest, SamplingParams
from engine.batch_invariance import shape_key
from engine.cpu_linear import _RowWise
from engine.engine import Engine
from engine.model import LoadedModel, load_model
from tools.bench.common import bench
from tools.lab.common import Report
from tools.prompts import load_prompts

BATCHES = (1, 2, 4, 8, 16, 32)


def prompt_ids(loaded: LoadedModel, batch: int, length: int) -> list[list[int]]:
    prompts = load_prompts()
    return [loaded.tokenizer.encode(prompts[i % len(prompts)])[:length] for i in range(batch)]


def engine_stepper(loaded: LoadedModel, ids: list[list[int]], steps: int) -> Engine:
    """An engine with every row admitted and prefilled, ready to decode ``steps`` times."""
    engine = Engine(loaded, max_batch=len(ids), num_blocks=len(ids) * 8 + 8, block_size=16)
    for i, row in enumerate(ids):
        text = loaded.tokenizer.decode(row)
        assert isinstance(text, str)
        params = SamplingParams(ignore_eos=True)
        engine.submit(GenerationRequest(f"b{i}", text, steps + 2, sampling=params))
    engine.step()  # admission and every prefill
    return engine


def plain_stepper(model: PreTrainedModel, ids: list[list[int]]) -> Callable[[], None]:
    """A closure doing one decode step of plain transformers, after a batched prefill."""
    width = min(len(r) for r in ids)
    input_ids = torch.tensor([r[:width] for r in ids], device=model.device)
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        out = model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=1)
    state = {"next": out.logits[:, -1].argmax(-1, keepdim=True)}

    @torch.inference_mode()
    def step() -> None:
        out = model(input_ids=state["next"], cache=cache, use_cache=True, logits_to_keep=1)
        state["next"] = out.logits[:, -1].argmax(-1, keepdim=True)

    return step


def measure(
    loaded: LoadedModel, plain: PreTrainedModel, ids: list[list[int]], steps: int, warmup: int
) -> tuple[float, float]:
    """Median ms of an engine step and of a plain step, timed alternately."""
    engine = engine_stepper(loaded, ids, warmup + steps)
    plain_step = plain_stepper(plain, ids)
    engine_ms, plain_ms = [], []
    for _ in range(warmup + steps):
        started = time.perf_counter()
        engine.step()
        engine_ms.append((time.perf_counter() - started) * 1000)
        started = time.perf_counter()
        plain_step()
        plain_ms.append((time.perf_counter() - started) * 1000)
    return statistics.median(engine_ms[warmup:]), statistics.median(plain_ms[warmup:])


def rows_per_call(loaded: LoadedModel, bound: str = "rows_per_call") -> dict[str, int]:
    """The calibrated most rows per call of each layer shape (``engine.batch_invariance``),
    or with ``bound="min_rows_per_call"`` the fewest (2 where a lone row is padded)."""
    return {f"{kind} {in_f}->{out_f}": getattr(m, bound)
            for m in loaded.model.modules() if isinstance(m, _RowWise)
            for kind, out_f, in_f in [shape_key(m)]}


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None)
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--steps", type=int, default=16, help="timed decode steps per run")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=32)


@bench("step", "one decode step: the engine against plain transformers, per batch",
       arguments=arguments)
def run(args: argparse.Namespace) -> Report:
    loaded = load_model(args.model, args.device, precision=args.precision)
    # A second load, not a copy (a packed bfloat16 weight cannot be deep-copied), made
    # before the engine switches the first one's attention.
    plain = load_model(args.model, args.device, precision=args.precision).model
    plain.set_attn_implementation("sdpa")
    # One untimed round first: the first forward passes pay one-off costs
    # (allocator growth, kernel selection) that belong to neither side.
    measure(loaded, plain, prompt_ids(loaded, 2, args.prompt_tokens), 2, 0)
    rows = []
    for batch in tqdm(args.batches, desc="batch sizes"):
        ids = prompt_ids(loaded, batch, args.prompt_tokens)
        engine_ms, plain_ms = measure(loaded, plain, ids, args.steps, args.warmup)
        rows.append({"batch": batch, "engine_ms": round(engine_ms, 2),
                     "transformers_ms": round(plain_ms, 2),
                     "ratio": round(engine_ms / plain_ms, 3)})
    base = rows[0]["engine_ms"]
    for row in rows:
        row["x_smallest_batch"] = round(row["engine_ms"] / base, 2)
    summary = {
        "model": args.model,
        "device": str(loaded.device),
        "precision": loaded.precision,
        "prompt_tokens": args.prompt_tokens,
        "timed_steps": args.steps,
        "engine_ms_by_batch": {str(r["batch"]): r["engine_ms"] for r in rows},
        "ratio_at_largest_batch": rows[-1]["ratio"],
        "largest_over_smallest_batch": round(rows[-1]["engine_ms"] / base, 3),
        "rows_per_call": rows_per_call(loaded),
        "min_rows_per_call": rows_per_call(loaded, "min_rows_per_call"),
    }
    return Report(summary, {"rows": rows})
