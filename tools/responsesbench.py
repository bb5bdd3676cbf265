"""Time to first token of a late turn: ``previous_response_id`` with the prefix cache
against the same conversation sent whole without it, in one run.

``python -m tools.responsesbench [--turns 8] [--reps 3] [--json FILE]`` starts the
server (``tools.server``, the embedded model unless ``--model``) with the prefix cache on,
and for each of ``--reps`` conversations (each opening with a different question, so no
conversation finds another's turns cached) makes turns 1 to ``turns - 1`` with
``previous_response_id`` (greedy, ``--answer`` output tokens each), then streams the
last turn the same way and times it: from the request to its first
``response.output_text.delta``, through the official SDK. The same last turn is then
sent whole (every earlier turn as input items, no ``previous_response_id``) to the same
server (the cache has the conversation: how much ``previous_response_id`` itself costs),
and, after that server stops, to a second one with ``STREAMSCOPE_PREFIX_CACHE=false``
(the baseline: the whole conversation prefilled). Each server answers one warm-up
request first. Writes medians, every sample, and the prompt's length in tokens as the
server counted it (the same rendered prompt in every mode, checked). Run it on an
otherwise quiet machine, or under ``nice`` and say so: the figures are ratios of one run.
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
    wholes: list[list[dict[str, Any]]] = []
    with serve({**common, "prefix_cache": True}) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        first_token_ms(client, input="Warm up.", **last)
        for rep in range(args.reps):
            items, previous = conversation(client, args.model,
                                           QUESTIONS[rep % len(QUESTIONS)],
                                           args.turns, args.answer)
            ms, tokens = first_token_ms(client, input=FOLLOW_UP,
                                        previous_response_id=previous, **last)
            chained.append(ms)
            lengths.add(tokens)
            whole = [*items, {"role": "user", "content": FOLLOW_UP}]
            wholes.append(whole)
            ms, tokens = first_token_ms(client, input=whole, **last)
            whole_cached.append(ms)
            lengths.add(tokens)
    with serve({**common, "prefix_cache": False}) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        first_token_ms(client, input="Warm up.", **last)
        for whole in wholes:
            ms, tokens = first_token_ms(client, input=whole, **last)
            whole_uncached.append(ms)
            lengths.add(tokens)
    p50 = statistics.median
    return {
        "model": args.model, "turn": args.turns, "reps": args.reps,
        "answer_tokens_per_turn": args.answer,
        "prompt_tokens": sorted(lengths),
        "ttft_ms_p50": {"previous_response_id_cached": round(p50(chained), 1),
                        "whole_cached": round(p50(whole_cached), 1),
                        "whole_uncached": round(p50(whole_uncached), 1)},
        "uncached_over_chained": round(p50(whole_uncached) / p50(chained), 2),
        "samples_ms": {"previous_response_id_cached": [round(x, 1) for x in chained],
                       "whole_cached": [round(x, 1) for x in whole_cached],
                       "whole_uncached": [round(x, 1) for x in whole_uncached]},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
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
