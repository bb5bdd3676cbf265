"""Choosing each row's next token from its logits.

Greedy rows take the argmax of the whole batch at once. A sampled row draws
from its own ``torch.Generator``, seeded from the request's seed, using only
its own logits: its tokens do not depend on which other rows share the batch.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from .types import SamplingParams

# A temperature below this is greedy: dividing logits by it would overflow float32 to
# inf (and the softmax to NaN), and the distribution is an argmax long before (vLLM's
# _SAMPLING_EPS is the same).
GREEDY_BELOW_TEMPERATURE = 1e-5

# Samples' worth of variates ``advance`` draws at once: 64 x a 50k vocabulary is 12 MiB
# of float32, a bounded buffer however long the stream was.
ADVANCE_CHUNK = 64


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """A generator for a sampled request (None for greedy)."""
    if params.temperature < GREEDY_BELOW_TEMPERATURE:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(params.seed if params.seed is not None else random.getrandbits(63))
    return generator


def advance(generator: torch.Generator, vocab_size: int, draws: int) -> None:
    """Advance ``generator`` past ``draws`` samples over ``vocab_size`` logits, as if
    ``_sample_row`` had drawn them (a stream rebuilt after its owner died goes on with
    the state the uninterrupted run had).

    ``torch.multinomial(probs, 1)`` takes one exponential variate per element of
    ``probs`` (``q = exponential_(); argmax(probs / q)``): what it takes from the
    generator depends on the vocabulary's size, never on the probabilities, the
    temperature, top-k or top-p. On the CPU that is drawn here directly, in bulk (the
    same sequence of variates, several times faster than one sampling call per
    token); elsewhere by repeating the call on uniform probabilities. Both are checked
    against real sampling in ``tests/test_failover_engine.py``.
    """
    if generator.device.type == "cpu":
        for start in range(0, draws, ADVANCE_CHUNK):
            size = min(ADVANCE_CHUNK, draws - start) * vocab_size
            torch.empty(size).exponential_(generator=generator)
        return
    uniform = torch.full((vocab_size,), 1.0 / vocab_size, device=generator.device)
    for _ in range(draws):
        torch.multinomial(uniform, 1, generator=generator)


def greedy(logits: torch.Tensor) -> list[int]:
    """The argmax of each row of ``logits`` (batch, vocab), for the whole batch at once."""
    ids = logits.argmax(dim=-1).tolist()
    assert isinstance(ids, list)
    return ids


def sample(
    logits: torch.Tensor, rows: Sequence[tuple[SamplingParams, torch.Generator | None]]
) -> list[int | Exception]:
    """Each row's next token (greedy: the argmax; else drawn from the row's logits with
    its own generator), or the exception drawing it raised; the
    rows of ``logits`` (batch, vocab) in order, with each row's params and generator.

    A greedy row (no generator) takes its argmax from one call for the whole batch and
    is never indexed on its own: at batch 256 a per-row ``logits[row]`` was most of
    sampling a step of greedy rows.
    """
    greedy_ids = greedy(logits)
    outcomes: list[int | Exception] = []
    for row, (params, generator) in enumerate(rows):
        if generator is None:
            outcomes.append(greedy_ids[row])
            continue
        try:
            outcomes.append(_sample_row(logits[row], params, generator))
        except Exception as exc:
            outcomes.append(exc)
    return outcomes


def _sample_row(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator) -> int:
    scores = logits.float() / p.temperature
    if 0 < p.top_k < scores.numel():
        kth = torch.topk(scores, p.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        cumulative = sorted_scores.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_scores.softmax(-1) >= p.top_p  # keep the first over top_p
        drop[0] = False  # the likeliest always stays (a top_p below float32's least is 0)
        scores = scores.scatter(0, order[drop], float("-inf"))
    probs = scores.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())
