"""What penalties and logit bias cost a step's sampling, and what a batch without them pays.

``python -m tools.bench penalties`` times, per batch size, on random logits of the
embedded model's vocabulary (49,152; no model is loaded) and each row's history of
``--prompt`` prompt and ``--generated`` generated token ids:

* ``sample_ms``: ``sampling.sample`` of the batch, greedy (the reference: what a step's
  sampling costs anyway);
* ``plain_us``: ``penalties.penalize`` called as ``ModelRunner._sample`` calls it (the
  rows' list built, then the check) on a batch whose rows ask for nothing: the fast
  path, which must stay negligible against ``sample_ms``;
* ``penalised_ms``: the same with every row asking for all four (``frequency_penalty``,
  ``presence_penalty``, ``repetition_penalty``, a 10-token ``logit_bias``).

Each figure is the median of ``--rounds`` calls, after one warm-up call.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from engine import SamplingParams
from engine.penalties import penalize
from engine.sampling import sample
from tools.bench.common import bench
from tools.lab.common import Report

VOCAB = 49_152  # the embedded SmolLM2-135M's


def penalised(vocab: int) -> SamplingParams:
    """Every row's parameters on the penalised side: all four."""
    return SamplingParams(frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.2,
                          logit_bias=tuple(((i * 997) % vocab, 1.5) for i in range(10)))


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens per row")
    parser.add_argument("--generated", type=int, default=256, help="generated tokens per row")
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--device", default="cpu")


def _median_s(call: Callable[[], Any], rounds: int) -> float:
    call()  # warm-up
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _row(batch: int, args: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    """One batch size's figures (the module docstring)."""
    device = torch.device(args.device)
    logits = torch.randn(batch, args.vocab, device=device)
    histories = [([rng.randrange(args.vocab) for _ in range(args.prompt)],
                  [rng.randrange(args.vocab) for _ in range(args.generated)])
                 for _ in range(batch)]
    plain = [SamplingParams()] * batch
    asking = [penalised(args.vocab)] * batch
    work = logits.clone()  # penalised again each round: the values drift, the work does not

    def penalise(params: list[SamplingParams]) -> None:
        penalize(work, [(p, prompt, generated)
                        for p, (prompt, generated) in zip(params, histories, strict=True)])

    sample_s = _median_s(lambda: sample(logits, [(p, None) for p in plain]), args.rounds)
    plain_s = _median_s(lambda: penalise(plain), args.rounds)
    penalised_s = _median_s(lambda: penalise(asking), args.rounds)
    return {"batch": batch, "sample_ms": round(sample_s * 1000, 3),
            "plain_us": round(plain_s * 1e6, 1), "penalised_ms": round(penalised_s * 1000, 3),
            "plain_over_sample": round(plain_s / sample_s, 4)}


@bench("penalties", "penalties and logit bias against a step's sampling; the unpenalised "
       "batch's cost", arguments=arguments)
def run(args: argparse.Namespace) -> Report:
    if args.threads:
        torch.set_num_threads(args.threads)
    rng = random.Random(0)
    rows = [_row(batch, args, rng) for batch in args.batches]
    summary = {"device": args.device, "vocab": args.vocab, "prompt": args.prompt,
               "generated": args.generated,
               "plain_us": {r["batch"]: r["plain_us"] for r in rows},
               "sample_ms": {r["batch"]: r["sample_ms"] for r in rows},
               "penalised_ms": {r["batch"]: r["penalised_ms"] for r in rows}}
    return Report(summary, {"rows": rows})
