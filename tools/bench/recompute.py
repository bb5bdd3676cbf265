"""What a stream rebuilt from its tokens costs: a failover's, or a preemption's, recompute.

``python -m tools.bench recompute --precision bfloat16`` generates one stream of the
embedded model, then, for each ``--after`` k, rebuilds it from its first k tokens
(``Engine.submit(request, resume_from=...)``: the prompt prefilled, the k tokens
replayed as the decode rows that made them) and times the wait for its next token;
beside it, alternated in each round, a fresh request whose prompt is the same text
(prompt and the k tokens' text: a prefill of about as many positions, what a causal
re-prefill of them cost). Reports each median, their ratio, and whether every rebuilt
continuation equals the uninterrupted stream's tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from engine import GenerationRequest, SamplingParams, TokenEvent
from engine.engine import Engine
from engine.model import load_model
from tools.bench.common import bench
from tools.lab.common import Report

PROMPT = "Write a long story about a lighthouse keeper and the ships she watched."
FOLLOWING = 4  # tokens of each continuation compared with the uninterrupted stream's


def first_token_ms(engine: Engine, request: GenerationRequest,
                   resume_from: list[int]) -> tuple[float, list[int]]:
    """The wait for ``request``'s first new token, and its token ids (run to the end)."""
    engine.submit(request, resume_from)
    started, first, ids = time.perf_counter(), None, []
    while engine.has_work():
        for event in engine.step():
            if isinstance(event, TokenEvent) and event.request_id == request.request_id:
                ids.append(event.token_id)
                first = first or (time.perf_counter() - started) * 1000
    assert first is not None
    return first, ids


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None)
    parser.add_argument("--after", type=int, nargs="+", default=[50, 200, 400],
                        help="tokens generated before the rebuild")
    parser.add_argument("--rounds", type=int, default=3)


@bench("recompute", "a stream rebuilt from its tokens (replayed) against a fresh prefill "
       "of as many positions", arguments=arguments)
def run(args: argparse.Namespace) -> Report:
    loaded = load_model(args.model, args.device, precision=args.precision)
    engine = Engine(loaded, max_batch=2, num_blocks=256, block_size=16)
    greedy = SamplingParams(ignore_eos=True)
    longest = max(args.after) + FOLLOWING

    def request(name: str, prompt: str, tokens: int) -> GenerationRequest:
        return GenerationRequest(name, prompt, tokens, sampling=greedy)

    _, whole = first_token_ms(engine, request("whole", PROMPT, longest), [])
    times: dict[int, dict[str, list[float]]] = {k: {"rebuilt": [], "fresh": []} for k in args.after}
    equal = True
    for round_ in range(args.rounds):
        for k in args.after:
            ms, ids = first_token_ms(engine, request(f"r{round_}-{k}", PROMPT, k + FOLLOWING),
                                     whole[:k])
            times[k]["rebuilt"].append(ms)
            equal = equal and ids == whole[k : k + FOLLOWING]
            generated = loaded.tokenizer.decode(whole[:k])
            assert isinstance(generated, str)
            text = PROMPT + generated
            ms, _ = first_token_ms(engine, request(f"f{round_}-{k}", text, 1), [])
            times[k]["fresh"].append(ms)
    rows: list[dict[str, Any]] = []
    for k, sides in times.items():
        rebuilt, fresh = (statistics.median(sides[s]) for s in ("rebuilt", "fresh"))
        rows.append({"after": k, "rebuilt_ms": round(rebuilt, 1), "fresh_prefill_ms":
                     round(fresh, 1), "ratio": round(rebuilt / fresh, 3),
                     "runs": {s: [round(t, 1) for t in v] for s, v in sides.items()}})
    summary = {"model": args.model, "precision": loaded.precision, "rounds": args.rounds,
               "continuations_equal": equal,
               "rebuilt_over_fresh": {r["after"]: r["ratio"] for r in rows},
               "rebuilt_ms": {r["after"]: r["rebuilt_ms"] for r in rows}}
    return Report(summary, {"rows": rows})
