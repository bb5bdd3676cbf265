"""Would prompt-lookup speculation speed up one stream? Its acceptance and a step's cost.

``python -m tools.bench lookup --precision int4 --threads 2`` answers the question before
anyone builds it (issue 44: one stream against ``llama-server``). Speculative decoding
with prompt lookup (transformers' ``PromptLookupCandidateGenerator``, vLLM's ``ngram``)
guesses a sequence's next tokens from an earlier occurrence of its last few tokens, and
checks the guesses with one pass of several rows; with greedy decoding the tokens are the
same, and a pass gives the accepted guesses plus one token of its own. It pays only where
the guesses are right often enough to cover the wider pass, so this bench measures both:

* **acceptance**: the model's greedy answers to ``--prompts`` prompts of
  ``tools/prompts.txt`` (``--max-new-tokens`` each, as the side-by-side asks: end of
  sequence ignored), then, at every point of each answer, the library's lookup guesses
  ``k`` tokens (``--drafts``) from the prompt and the answer so far, and the longest run
  of them equal to what the model said is accepted: tokens per pass, rows per pass;
* **cost**: the engine's decode step at 1 to ``max(--drafts) + 1`` rows (rows of
  different sequences of one length bucket, the sizes taking turns step by step), as
  its ratio to one row; a pass checking ``d`` guesses has ``d + 1`` rows;
* **projection**: per ``k``, the answers' tokens over the passes' summed cost (in one-row
  steps): the tokens/s it would give relative to plain decoding. A projection, not a
  measurement of built speculation: the rows of one sequence's pass attend over
  positions one apart, the proxy's over the same length.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, cast

import torch
from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

from engine import GenerationRequest, SamplingParams, TokenEvent
from engine.engine import Engine
from engine.model import LoadedModel, load_model
from tools.bench.common import bench
from tools.bench.step import engine_stepper, prompt_ids
from tools.lab.common import Report
from tools.prompts import load_prompts

# transformers' own default n-gram for prompt lookup is 2; 3 finds as many here and
# longer matches first (HF's assisted generation docs use 3 in their example)
MATCHING_NGRAM = 3


def greedy_answers(loaded: LoadedModel, prompts: int, new_tokens: int
                   ) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, ``new_tokens`` greedy ids) for the first ``prompts`` prompts, as the
    engine answers them (together: a concurrent answer is its solo run)."""
    texts = load_prompts()[:prompts]
    engine = Engine(loaded, max_batch=len(texts), num_blocks=len(texts) * 16 + 16, block_size=16)
    answers: dict[str, list[int]] = {}
    for i, text in enumerate(texts):
        answers[f"p{i}"] = []
        engine.submit(GenerationRequest(f"p{i}", text, new_tokens,
                                        sampling=SamplingParams(ignore_eos=True)))
    while engine.has_work():
        for event in engine.step():
            if isinstance(event, TokenEvent):
                answers[event.request_id].append(event.token_id)
    return [(loaded.tokenizer.encode(text), answers[f"p{i}"]) for i, text in enumerate(texts)]


def passes(prompt: list[int], answer: list[int], drafts: int) -> list[tuple[int, int]]:
    """(guesses checked, tokens made) of each pass a speculating decode of ``answer``
    after ``prompt`` would make, guessing ``drafts`` tokens by prompt lookup."""
    lookup = PromptLookupCandidateGenerator(num_output_tokens=drafts,
                                            max_matching_ngram_size=MATCHING_NGRAM,
                                            max_length=len(prompt) + len(answer) + drafts + 2)
    made: list[tuple[int, int]] = []
    done = 0
    while done < len(answer):
        context = cast(torch.LongTensor, torch.tensor([prompt + answer[:done]]))
        candidates, _ = lookup.get_candidates(context)
        guesses = candidates[0, context.shape[1]:].tolist()
        accepted = 0
        while (accepted < len(guesses) and done + accepted < len(answer)
               and guesses[accepted] == answer[done + accepted]):
            accepted += 1
        made.append((len(guesses), min(accepted + 1, len(answer) - done)))
        done += accepted + 1
    return made


def step_cost(loaded: LoadedModel, widest: int, steps: int, warmup: int,
              prompt_tokens: int) -> dict[int, float]:
    """Median decode step ms at 1..``widest`` rows, the sizes taking turns."""
    engines = {rows: engine_stepper(loaded, prompt_ids(loaded, rows, prompt_tokens),
                                    steps + warmup)
               for rows in range(1, widest + 1)}
    times: dict[int, list[float]] = {rows: [] for rows in engines}
    for index in range(steps + warmup):
        for rows, engine in engines.items():
            started = time.perf_counter()
            engine.step()
            if index >= warmup:
                times[rows].append((time.perf_counter() - started) * 1000)
    return {rows: statistics.median(values) for rows, values in times.items()}


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--drafts", type=int, nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--steps", type=int, default=40, help="timed steps per row count")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=32,
                        help="the cost's rows' prompts cut to this length (the prompts of "
                        "tools/prompts.txt are 34-46 tokens: at 32, one length bucket)")


@bench("lookup", "prompt-lookup speculation for one stream: its acceptance, a wider "
       "step's cost, and the speed-up they project", arguments=arguments)
def run(args: argparse.Namespace) -> Report:
    loaded = load_model(args.model, "cpu", precision=args.precision)
    answers = greedy_answers(loaded, args.prompts, args.max_new_tokens)
    cost_ms = step_cost(loaded, max(args.drafts) + 1, args.steps, args.warmup,
                        args.prompt_tokens)
    relative = {rows: ms / cost_ms[1] for rows, ms in cost_ms.items()}
    by_drafts: dict[str, Any] = {}
    for drafts in args.drafts:
        made = [p for prompt, answer in answers for p in passes(prompt, answer, drafts)]
        tokens = sum(n for _, n in made)
        cost = sum(relative[guesses + 1] for guesses, _ in made)
        by_drafts[str(drafts)] = {
            "tokens_per_pass": round(tokens / len(made), 3),
            "rows_per_pass": round(sum(g + 1 for g, _ in made) / len(made), 3),
            "passes_with_guesses": round(sum(1 for g, _ in made if g) / len(made), 3),
            "projected_speedup": round(tokens / cost, 3),
        }
    summary = {
        "model": args.model, "precision": loaded.precision, "prompts": len(answers),
        "tokens_per_answer": args.max_new_tokens,
        "step_ms_by_rows": {str(r): round(ms, 2) for r, ms in cost_ms.items()},
        "step_cost_by_rows": {str(r): round(v, 3) for r, v in relative.items()},
        "by_drafts": by_drafts,
    }
    return Report(summary, {"answers": [answer for _, answer in answers]})
