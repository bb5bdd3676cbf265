"""``precision``: concurrent against solo in each precision, and each one against float32.

The reference chapter's exercise 7, in-process on the engine (``engine.Engine``), for each
precision the product offers (``engine.precision``)::

    nice -n 15 python -m tools.lab precision --prompts 32 --max-new-tokens 32
    python -m tools.lab precision --quick             # tiny-gpt2, seconds

Per precision, on the first ``--prompts`` of ``tools/prompts.txt``:

1. solo: each prompt alone in the engine, greedy, and the first ``--seeded`` prompts
   again with seeded sampling (temperature 0.8, top-p 0.9, a seed per prompt);
2. concurrent: all the greedy requests submitted at once, then all the seeded ones;
3. each concurrent answer against its solo one: identical, or the first divergence,
   with the margin between the top two logits at that position in both runs (every
   request asks for its top-2 log-probabilities: their difference times the temperature
   is the logits' difference; a tiny margin means a near-tie that rounding can flip).

And each precision's solo greedy answers against float32's: the share of identical
answers, and for the others the first differing position and float32's margin there.
Beside them, the engine's median decode step at batch 1 (the solo runs) and at the
concurrent batch (the steps where every greedy request was decoding), so the trade is
in one run: speed against agreement.

The model is loaded in this process (``--model``; default smollm2, tiny-gpt2 under
``--quick``; ``--threads`` sets this process's torch threads too); the lab's server it
starts (tiny-gpt2 unless ``--model``) only idles.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import trio

from engine import FinishEvent, GenerationRequest, SamplingParams
from engine.engine import Engine
from engine.model import load_model
from engine.precision import PRECISIONS
from tools.lab.common import Lab, Report, experiment

SEEDED: dict[str, Any] = {"temperature": 0.8, "top_p": 0.9}
TOP = 2  # the top two logits at each position


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=None,
                        help="default: every one (float32, bfloat16, int8, int4)")
    parser.add_argument("--prompts", type=int, default=None, help="greedy prompts (32)")
    parser.add_argument("--seeded", type=int, default=None, help="seeded prompts (8)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="(64)")


@experiment("precision", "concurrent vs solo per precision (first divergence by margin), "
            "and each precision's greedy text against float32's",
            server={"model": "tiny-gpt2"}, arguments=arguments)
async def precision(lab: Lab) -> Report:
    args = lab.args
    model = args.model or lab.pick("smollm2", "tiny-gpt2")
    chosen = list(args.precisions or PRECISIONS)
    if "float32" not in chosen:
        chosen.insert(0, "float32")  # the reference every other one is compared with
    greedy_n = args.prompts or lab.pick(32, 4)
    seeded_n = args.seeded if args.seeded is not None else lab.pick(8, 2)
    tokens = args.max_new_tokens or lab.pick(64, 8)
    prompts = lab.prompts(max(greedy_n, seeded_n))
    if args.threads:  # this process's torch threads (the engine runs here)
        torch.set_num_threads(args.threads)
    runs: dict[str, dict[str, Any]] = {}
    for name in chosen:
        runs[name] = await trio.to_thread.run_sync(
            _run_precision, model, name, prompts[:greedy_n], prompts[:seeded_n], tokens)
    reference = runs["float32"]["solo"]["greedy"]
    summary: dict[str, Any] = {"model": model, "prompts": greedy_n, "seeded": seeded_n,
                               "max_new_tokens": tokens}
    raw: dict[str, Any] = {}
    for name, run in runs.items():
        identity = {mode: compare(run["solo"][mode], run["concurrent"][mode])
                    for mode in ("greedy", "seeded")}
        departs = compare(reference, run["solo"]["greedy"])
        summary[f"step_ms_1_{name}"] = run["step_ms_1"]
        summary[f"step_ms_{greedy_n}_{name}"] = run["step_ms_batch"]
        for mode, result in identity.items():
            summary[f"concurrent_identical_{mode}_{name}"] = result["identical"]
        summary[f"same_as_float32_share_{name}"] = departs["identical_share"]
        summary[f"first_difference_median_{name}"] = departs["first_difference_median"]
        raw[name] = {"identity": identity, "against_float32": departs,
                     "load_s": run["load_s"], "answers": run["solo"]["greedy"]}
    return Report(summary=summary, raw=raw)


def _run_precision(model: str, name: str, greedy: list[str], seeded: list[str],
                   tokens: int) -> dict[str, Any]:
    """Solo then concurrent runs of one precision (in a worker thread: it blocks)."""
    started = time.perf_counter()
    loaded = load_model(model, "cpu", precision=name)
    load_s = time.perf_counter() - started
    requests = {
        "greedy": [_request(f"g{i}", p, tokens, SamplingParams(
            ignore_eos=True, logprobs=True, top_logprobs=TOP)) for i, p in enumerate(greedy)],
        "seeded": [_request(f"s{i}", p, tokens, SamplingParams(
            ignore_eos=True, logprobs=True, top_logprobs=TOP, seed=1000 + i, **SEEDED))
            for i, p in enumerate(seeded)],
    }
    options: dict[str, Any] = {"max_batch": max(len(greedy), len(seeded), 1), "num_blocks": 1024,
               "block_size": 16}
    solo: dict[str, list[dict[str, Any]]] = {}
    solo_steps: list[float] = []
    for mode, batch in requests.items():
        solo[mode] = []
        for request in batch:
            tokens_of, steps = _run(Engine(loaded, **options), [request])
            solo[mode].append(tokens_of[request.request_id])
            solo_steps += steps[1:]  # the first step is the prefill
    concurrent: dict[str, list[dict[str, Any]]] = {}
    batch_steps: list[float] = []
    for mode, batch in requests.items():
        tokens_of, steps = _run(Engine(loaded, **options), batch)
        concurrent[mode] = [tokens_of[r.request_id] for r in batch]
        if mode == "greedy":
            batch_steps = steps
    return {"solo": solo, "concurrent": concurrent, "load_s": round(load_s, 2),
            "step_ms_1": _median_ms(solo_steps), "step_ms_batch": _median_ms(batch_steps)}


def _request(rid: str, prompt: str, tokens: int, params: SamplingParams) -> GenerationRequest:
    return GenerationRequest(rid, prompt, tokens, sampling=params)


def _run(engine: Engine, batch: list[GenerationRequest]) -> tuple[dict[str, Any], list[float]]:
    """Each request's answer ({ids, text, margins}) and the times of the steps in which
    every request of ``batch`` was decoding (none was still waiting for its first token)."""
    for request in batch:
        engine.submit(request)
    answers: dict[str, dict[str, Any]] = {
        r.request_id: {"ids": [], "text": "", "margins": []} for r in batch}
    temperature = {r.request_id: r.sampling.temperature or 1.0 for r in batch}
    started: set[str] = set()
    steps: list[float] = []
    while engine.has_work():
        decoding = len(started) == len(batch)
        t0 = time.perf_counter()
        events = engine.step()
        if decoding:
            steps.append(time.perf_counter() - t0)
        for event in events:
            if isinstance(event, FinishEvent):
                continue
            answer = answers[event.request_id]
            started.add(event.request_id)
            answer["ids"].append(event.token_id)
            answer["text"] += event.text
            top = event.logprobs.top if event.logprobs is not None else ()
            margin = (top[0][2] - top[1][2]) * temperature[event.request_id] if len(
                top) >= TOP else None
            answer["margins"].append(None if margin is None else round(margin, 5))
    return answers, steps


def compare(reference: list[dict[str, Any]], other: list[dict[str, Any]]) -> dict[str, Any]:
    """How ``other``'s answers depart from ``reference``'s, prompt by prompt: identical
    or not, and the first differing position with both runs' top-2 margins there."""
    rows: list[dict[str, Any]] = []
    for i, (ref, got) in enumerate(zip(reference, other, strict=True)):
        first = next((k for k, (a, b) in enumerate(zip(ref["ids"], got["ids"], strict=False))
                      if a != b), None)
        if first is None and len(ref["ids"]) != len(got["ids"]):
            first = min(len(ref["ids"]), len(got["ids"]))
        rows.append({"prompt": i, "identical": first is None, "first_difference": first,
                     "margin_reference": None if first is None else _at(ref["margins"], first),
                     "margin_other": None if first is None else _at(got["margins"], first)})
    firsts = [r["first_difference"] for r in rows if r["first_difference"] is not None]
    return {"identical": sum(r["identical"] for r in rows), "of": len(rows),
            "identical_share": round(sum(r["identical"] for r in rows) / max(len(rows), 1), 3),
            "first_difference_median": statistics.median(firsts) if firsts else None,
            "rows": rows}


def _at(values: list[Any], index: int) -> Any:
    return values[index] if index < len(values) else None


def _median_ms(seconds: list[float]) -> float | None:
    return round(statistics.median(seconds) * 1000, 2) if seconds else None
