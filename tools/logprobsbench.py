"""What log-probabilities cost a decode step: batch 32 with and without them.

``python -m tools.logprobsbench [--json FILE]`` loads the embedded model once and builds
three engines over it, each with ``--batch`` sequences admitted and prefilled (the same
prompts, greedy, ``ignore_eos``), differing only in what the rows ask for:

* ``none``: no log-probabilities (every row's outcome a bare token id);
* ``logprobs``: each row's own (``logprobs``, ``top_logprobs`` 0);
* ``top20``: each row's own and the 20 likeliest (``top_logprobs`` 20), the most a
  request may ask.

Their decode steps alternate (none, logprobs, top20, none, ...) so that all three see the
same noise on a shared machine; the figure is each one's median step and its excess over
``none``. The sampling alone (``engine.sampling.sample`` on a random logits tensor of the
batch by the vocabulary, no forward pass) is timed the same way, to show what the
log-probabilities themselves take where the step's own noise hides it. The JSON records
the load average before and after (``os.getloadavg()``); run it under ``flock
/tmp/streamscope-bench.lock`` on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path

import torch

from engine import GenerationRequest, SamplingParams, sampling
from engine.engine import Engine
from engine.model import LoadedModel, load_model
from tools.prompts import load_prompts

CONDITIONS = {
    "none": SamplingParams(ignore_eos=True),
    "logprobs": SamplingParams(ignore_eos=True, logprobs=True),
    "top20": SamplingParams(ignore_eos=True, logprobs=True, top_logprobs=20),
}


def ready_engine(loaded: LoadedModel, params: SamplingParams, batch: int, prompt_tokens: int,
                 steps: int) -> Engine:
    """An engine with ``batch`` rows admitted and prefilled, ready to decode ``steps``."""
    engine = Engine(loaded, max_batch=batch, num_blocks=batch * 8 + 8, block_size=16)
    prompts = load_prompts()
    for i in range(batch):
        ids = loaded.tokenizer.encode(prompts[i % len(prompts)])[:prompt_tokens]
        engine.submit(GenerationRequest(f"b{i}", "", steps + 2 + batch, sampling=params,
                                        prompt_token_ids=tuple(ids)))
    while engine.scheduler.prompt_tokens_to_prefill() or engine.scheduler.waiting:
        engine.step()  # admission and the prefills (several steps: the prefill budget)
    return engine


def alternate(runs: Mapping[str, Callable[[], object]], rounds: int, warmup: int
              ) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Median ms of each run, the runs taking turns ``warmup + rounds`` times (each round
    starting with the next one, so that none is always first or last)."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for turn in range(warmup + rounds):
        for name in names[turn % len(names):] + names[:turn % len(names)]:
            run = runs[name]
            started = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - started) * 1000)
    timed = {name: [round(x, 3) for x in t[warmup:]] for name, t in times.items()}
    return {name: round(statistics.median(t), 3) for name, t in timed.items()}, timed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.logprobsbench", description=__doc__)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--device", default=None)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=24, help="timed decode steps each")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None, help="torch's intra-op threads")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    load_before = os.getloadavg()
    loaded = load_model(args.model, args.device)
    engines = {name: ready_engine(loaded, params, args.batch, args.prompt_tokens,
                                  args.steps + args.warmup)
               for name, params in CONDITIONS.items()}
    step_ms, steps_raw = alternate({name: e.step for name, e in engines.items()}, args.steps,
                                   args.warmup)

    vocab = loaded.model.get_output_embeddings().weight.shape[0]
    logits = torch.randn(args.batch, vocab, generator=torch.Generator().manual_seed(0),
                         dtype=loaded.model.dtype).to(loaded.device)
    samples = {name: partial(sampling.sample, logits, [(params, None)] * args.batch)
               for name, params in CONDITIONS.items()}
    sample_ms, _ = alternate(samples, args.steps * 4, args.warmup)
    if loaded.device.type == "cuda":
        torch.cuda.synchronize()

    summary = {
        "model": args.model, "device": str(loaded.device), "batch": args.batch,
        "vocab": vocab, "torch_threads": torch.get_num_threads(),
        "step_ms": step_ms,
        "step_ms_quartiles": {n: [round(q, 1) for q in statistics.quantiles(t, n=4)]
                              for n, t in steps_raw.items()},
        "step_excess_ms": {n: round(v - step_ms["none"], 3) for n, v in step_ms.items()},
        "step_excess_share": {n: round(v / step_ms["none"] - 1, 4) for n, v in step_ms.items()},
        "sample_ms": sample_ms,
        "sample_excess_ms": {n: round(v - sample_ms["none"], 3) for n, v in sample_ms.items()},
        "timed_steps": args.steps,
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
    }
    print(json.dumps(summary, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"summary": summary, "step_ms": steps_raw}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
