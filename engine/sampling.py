"""Choosing each row's next token from its logits, and its log-probabilities.

Greedy rows take the argmax of the whole batch at once. A sampled row draws
from its own ``torch.Generator``, seeded from the request's seed, using only
its own logits: its tokens do not depend on which other rows share the batch.
The rows whose request asked for log-probabilities get them from the same logits
(``logprobs``: one ``log_softmax`` and one ``topk`` over those rows together, after
each one's temperature, before its top-k/top-p cut); the others pay nothing, and no
generator is drawn from for them, so the tokens are the same with or without.
A constrained row (``constraints``) has its grammar's mask applied to its logits first
(``constrain``): it samples, and reports log-probabilities, from what the grammar allows.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from typing import Any

import torch

from .constraint_costs import MASK_MS
from .constraints import ConstraintDeadEnd, ConstraintOverBudget
from .logprobs import MIN_LOGPROB, Outcome, Sampled
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


def constrain(logits: torch.Tensor, matchers: Sequence[object | None],
              budget_ms: float = MASK_MS) -> dict[int, ConstraintDeadEnd]:
    """Apply each constrained row's next-token mask to its row of ``logits`` (batch,
    vocab) in place (the others untouched); the rows that must end, each with why: its
    constraint allows no token (a dead end), or its mask took more than ``budget_ms``
    of this thread's CPU (``ConstraintOverBudget``: one row never holds the step
    longer than one mask, and the library's limits bound that mask). The caller
    finishes them. No mask work when no row is constrained.

    The library fills a bit mask per row (``llguidance.numpy``); it is unpacked and
    applied here with plain torch ops: ``llguidance.torch``'s own kernel is compiled by
    torch on its first call, which took 10 s on this machine, inside a step."""
    rows = [row for row, matcher in enumerate(matchers) if matcher is not None]
    if not rows:
        return {}
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    vocab = logits.shape[1]
    mask = allocate_token_bitmask(len(rows), vocab)
    ended: dict[int, ConstraintDeadEnd] = {}
    for index, row in enumerate(rows):
        matcher: Any = matchers[row]
        if matcher.is_error():
            ended[row] = ConstraintDeadEnd("the constraint allows no further token")
            continue
        started = time.thread_time()
        fill_next_token_bitmask(matcher, mask, index)
        spent_ms = (time.thread_time() - started) * 1000
        if spent_ms > budget_ms:
            ended[row] = ConstraintOverBudget(
                f"the constraint's mask took {spent_ms:.0f} ms of CPU, over the step's "
                f"budget of {budget_ms:g} ms a row")
    bits = torch.from_numpy(mask).unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)
    allowed = (bits & 1).flatten(1)[:, :vocab].bool().to(logits.device)
    every = len(rows) == logits.shape[0]
    scores = logits if every else logits[rows]  # a copy: written back below
    scores.masked_fill_(~allowed, float("-inf"))
    if not every:
        logits[rows] = scores
    for index in (~allowed.any(dim=1)).nonzero().flatten().tolist():
        ended.setdefault(rows[index], ConstraintDeadEnd("the constraint allows no further token"))
    return dict(sorted(ended.items()))


def greedy(logits: torch.Tensor) -> list[int]:
    """The argmax of each row of ``logits`` (batch, vocab), for the whole batch at once.

    Taken as ``max(dim).indices``: the same index as ``argmax`` (the first of tied
    maxima, a NaN's if any), and on the CPU a third of its time at batch 32 over the
    embedded model's 49,152 logits (``python -m tools.bench overhead``: its
    ``greedy_*_ms``)."""
    ids = logits.max(dim=-1).indices.tolist()
    assert isinstance(ids, list)
    return ids


def sample(
    logits: torch.Tensor, rows: Sequence[tuple[SamplingParams, torch.Generator | None]]
) -> list[Outcome]:
    """Each row's next token (greedy: the argmax; else drawn from the row's logits with
    its own generator), as a ``Sampled`` with its log-probabilities if its request asked,
    or the exception drawing it raised; the rows of ``logits`` (batch, vocab) in order,
    with each row's params and generator.

    A greedy row (no generator) takes its argmax from one call for the whole batch and
    is never indexed on its own: at batch 256 a per-row ``logits[row]`` was most of
    sampling a step of greedy rows.
    """
    greedy_ids = greedy(logits)
    outcomes: list[Outcome] = []
    for row, (params, generator) in enumerate(rows):
        if generator is None:
            outcomes.append(greedy_ids[row])
            continue
        try:
            outcomes.append(_sample_row(logits[row], params, generator))
        except Exception as exc:
            outcomes.append(exc)
    asked = [(row, token) for row, token in enumerate(outcomes)
             if isinstance(token, int) and rows[row][0].logprobs]
    if asked:
        found = logprobs(logits, [row for row, _ in asked], [token for _, token in asked],
                         [rows[row][0] for row, _ in asked])
        for (row, _), sampled in zip(asked, found, strict=True):
            outcomes[row] = sampled
    return outcomes


def logprobs(
    logits: torch.Tensor, rows: list[int], chosen: list[int], params: list[SamplingParams]
) -> list[Sampled]:
    """For each of ``rows`` (ascending) of ``logits``: the log-probability of its
    ``chosen`` token and its likeliest ``top_logprobs`` tokens', from the logits over
    its temperature (1 for a greedy row), in float32, in one pass over those rows."""
    scores = (logits if len(rows) == logits.shape[0] else logits[rows]).float()
    temperatures = [p.temperature if p.temperature >= GREEDY_BELOW_TEMPERATURE else 1.0
                    for p in params]
    if any(t != 1.0 for t in temperatures):
        scores = scores / torch.tensor(temperatures, device=scores.device).unsqueeze(1)
    table = torch.log_softmax(scores, dim=-1).clamp_(min=MIN_LOGPROB)
    picked = table.gather(1, torch.tensor(chosen, device=table.device).unsqueeze(1))
    values: list[float] = picked.squeeze(1).tolist()
    k = min(max(p.top_logprobs for p in params), table.shape[1])
    top_values: list[list[float]] = []
    top_ids: list[list[int]] = []
    if k:
        top = table.topk(k, dim=-1)
        top_values, top_ids = top.values.tolist(), top.indices.tolist()
    return [
        Sampled(token, value, tuple(zip(top_ids[i][:p.top_logprobs],
                                        top_values[i][:p.top_logprobs], strict=True))
                if k else ())
        for i, (token, value, p) in enumerate(zip(chosen, values, params, strict=True))
    ]


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
