"""Choosing each row's next token from its logits.

Greedy rows take the argmax of the whole batch at once. A sampled row draws
from its own ``torch.Generator``, seeded from the request's seed, using only
its own logits: its tokens do not depend on which other rows share the batch.
"""

from __future__ import annotations

import math
import random

import torch

from .errors import InvalidSampling
from .types import SamplingParams


def validate(params: SamplingParams) -> None:
    """Raise InvalidSampling for values no sampler can honour."""
    t, p, k, seed = params.temperature, params.top_p, params.top_k, params.seed
    if not (isinstance(t, int | float) and math.isfinite(t) and 0.0 <= t <= 100.0):
        raise InvalidSampling(f"temperature must be a number in [0, 100], got {t!r}")
    if not (isinstance(p, int | float) and math.isfinite(p) and 0.0 < p <= 1.0):
        raise InvalidSampling(f"top_p must be in (0, 1], got {p!r}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise InvalidSampling(f"top_k must be an integer >= 0, got {k!r}")
    if seed is not None and (
        isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63
    ):
        raise InvalidSampling(f"seed must be an integer in [0, 2**63), got {seed!r}")


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """A generator for a sampled request (None for greedy)."""
    if params.temperature == 0.0:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(params.seed if params.seed is not None else random.getrandbits(63))
    return generator


def greedy(logits: torch.Tensor) -> list[int]:
    """The argmax of each row of ``logits`` (batch, vocab), for the whole batch at once."""
    ids = logits.argmax(dim=-1).tolist()
    assert isinstance(ids, list)
    return ids


def choose(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None, greedy_id: int
) -> int:
    """One row's next token: ``greedy_id`` for a greedy row, else drawn from ``logits``
    (vocab,) with the row's own generator. May raise for this row alone."""
    return greedy_id if generator is None else _sample_row(logits, params, generator)


def _sample_row(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator) -> int:
    scores = logits.float() / p.temperature
    if 0 < p.top_k < scores.numel():
        kth = torch.topk(scores, p.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        cumulative = sorted_scores.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_scores.softmax(-1) >= p.top_p  # keep the first over top_p
        scores = scores.scatter(0, order[drop], float("-inf"))
    probs = scores.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator).item())
