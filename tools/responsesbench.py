"""Time to first token of a late turn: ``previous_response_id`` with the prefix cache
against the same conversation sent whole without it, in one run.

``python -m tools.responsesbench [--turns 8] [--reps 5] [--json FILE]`` starts two
servers (``tools.server``, the embedded model unless ``--model``), one with the prefix
cache and one with ``STREAMSCOPE_PREFIX_CACHE=false``. For each of ``--reps``
conversations (each opening with a different question, so none finds another's turns
cached) it makes turns 1 to ``turns - 1`` on the first with ``previous_response_id``
(greedy, ``--answer`` output tokens each), then times the last turn three ways, one
right after the other (the same load on the machine): with ``previous_response_id`` on
the first server; sent whole (every earlier turn as input items) to the second, the
baseline, whose prefill is the whole conversation; and sent whole to the first (the
cache has the conversation: what ``previous_response_id`` itself costs). A time is from
the request to its first ``response.output_text.delta``, streamed through the official
SDK. Each server answers one warm-up request first. Writes medians, every sample, the
per-conversation ratio uncached / chained and its median, and the prompts' lengths in
tokens as the server counted them. Run it on an otherwise quiet machine, or under
``nice`` and say so: the figures are ratios of one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import openai

from tools.server import serve

QUESTIONS = [
    "What is the capital of France?",
    "Name three rivers in Europe.",
    "How do bees make honey?",
    "Why is the sky blue?",
    "What is a prime number?",
]
FOLLOW_UP = "Tell me more, in one sentence."


def first_token_ms(client: openai.OpenAI, **fields: Any) -> tuple[float, int]:
    """(ms from the request to its first text delta, the prompt's tokens), streamed."""
    started = time.perf_counter()
    first = None
    tokens = 0
    with client.responses.create(stream=True, **fields) as events:
        for event in events:
            if first is None and event.type == "response.output_text.delta":
                first = (time.perf_counter() - started) * 1000
            if event.type in ("response.completed", "response.incomplete"):
                assert event.response.usage is not None
                tokens = event.response.usage.input_tokens
    assert first is not None, "no text came"
    return first, tokens


def conversation(client: openai.OpenAI, model: str, question: str, turns: int, answer: int
                 ) -> tuple[list[dict[str, Any]], str]:
    """Turns 1 .. ``turns - 1`` chained by ``previous_response_id``: (the whole
    conversation as input items, the last response's id)."""
    items: list[dict[str, Any]] = []
    previous = None
    for turn in range(1, turns):
        text = question if turn == 1 else FOLLOW_UP
        response = client.responses.create(
            model=model, input=text, previous_response_id=previous,
            max_output_tokens=answer, temperature=0)
        items += [{"role": "user", "content": text},
                  {"role": "assistant", "content": response.output_text}]
        previous = response.id
        print(f"turn {turn} made", file=sys.stderr, flush=True)
    assert previous is not None
    return items, previous


def run(args: argparse.Namespace) -> dict[str, Any]:
    common = {"model": args.model, "max_new_tokens_limit": 1024, "max_prompt_chars": 65536,
              "max_body_bytes": 1 << 20}
    chained: list[float] = []
    whole_cached: list[float] = []
    whole_uncached: list[float] = []
    lengths: set[int] = set()
    last = {"model": args.model, "max_output_tokens": 4, "temperature": 0}
    with serve({**common, "prefix_cache": True}) as cached_url, \
            serve({**common, "prefix_cache": False}) as uncached_url:
        cached = openai.OpenAI(base_url=f"{cached_url}/v1", api_key="unused", max_retries=0)
        uncached = openai.OpenAI(base_url=f"{uncached_url}/v1", api_key="unused",
                                 max_retries=0)
        for client in (cached, uncached):
            first_token_ms(client, input="Warm up.", **last)
        for rep in range(args.reps):
            items, previous = conversation(cached, args.model,
                                           QUESTIONS[rep % len(QUESTIONS)],
                                           args.turns, args.answer)
            whole = [*items, {"role": "user", "content": FOLLOW_UP}]
            # Side by side, one right after the other: the same load on the machine.
            for samples, client, fields in (
                    (chained, cached, {"input": FOLLOW_UP, "previous_response_id": previous}),
                    (whole_uncached, uncached, {"input": whole}),
                    (whole_cached, cached, {"input": whole})):
                ms, tokens = first_token_ms(client, **fields, **last)
                samples.append(ms)
                lengths.add(tokens)
            print(f"conversation {rep + 1}: {chained[-1]:.0f} ms chained, "
                  f"{whole_uncached[-1]:.0f} ms whole uncached, {whole_cached[-1]:.0f} ms "
                  "whole cached", file=sys.stderr, flush=True)
    p50 = statistics.median
    ratios = [u / c for u, c in zip(whole_uncached, chained, strict=True)]
    return {
        "model": args.model, "turn": args.turns, "reps": args.reps,
        "answer_tokens_per_turn": args.answer,
        "prompt_tokens": sorted(lengths),
        "ttft_ms_p50": {"previous_response_id_cached": round(p50(chained), 1),
                        "whole_cached": round(p50(whole_cached), 1),
                        "whole_uncached": round(p50(whole_uncached), 1)},
        "uncached_over_chained_p50": round(p50(ratios), 2),
        "uncached_over_chained_each": [round(r, 2) for r in ratios],
        "samples_ms": {"previous_response_id_cached": [round(x, 1) for x in chained],
                       "whole_cached": [round(x, 1) for x in whole_cached],
                       "whole_uncached": [round(x, 1) for x in whole_uncached]},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--answer", type=int, default=48, help="output tokens per turn")
    parser.add_argument("--json", help="write the result here too")
    result = run(parser.parse_args())
    text = json.dumps(result, indent=2)
    print(text)
    if parser.parse_args().json:
        with open(parser.parse_args().json, "w") as out:
            out.write(text + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
