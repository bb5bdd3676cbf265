"""A row's penalties and logit bias, applied to its logits before it samples.

OpenAI's ``logit_bias`` (a bias added to named tokens' logits), ``presence_penalty`` and
``frequency_penalty`` (subtracted for each token already generated: the frequency
penalty times its count, the presence penalty once), and vLLM's ``repetition_penalty``
(a token in the prompt or generated already has a positive logit divided by it, a
negative one multiplied). The order is vLLM's: the bias first, then the penalties.

Per row. Each penalised row is changed with its own parameters and from its own tokens
only, with elementwise operations on its own row: its result is the one it would have
alone, whatever its batch mates (``tests/test_engine_penalties.py`` checks concurrent ==
solo). The counts are taken from the sequence's tokens at each step (its prompt and its
``generated_ids``), never kept in state of their own: a sequence preempted and
recomputed, or rebuilt elsewhere from its tokens (``resume_from``), counts exactly what
the uninterrupted run counted.

The fast path. A batch whose rows change no logits (``SamplingParams.changes_logits``
false for each) costs one attribute check per row and no tensor work; only the rows that
ask are gathered, changed in float32 and written back, and in them only the tokens their
histories hold (the distinct (row, token) pairs, ``token_pairs``), never a dense count
over the vocabulary (``python -m tools.bench penalties``).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from itertools import chain

import torch

from .types import SamplingParams

# (params, prompt ids, generated ids) of one row of the logits.
Row = tuple[SamplingParams, Sequence[int], Sequence[int]]


def penalize(logits: torch.Tensor, rows: Sequence[Row]) -> None:
    """Apply each row's ``logit_bias`` and penalties to its row of ``logits`` (batch,
    vocab) in place; the rows that ask for none are not touched."""
    chosen = [row for row, (params, _, _) in enumerate(rows) if params.changes_logits]
    if not chosen:
        return
    every = len(chosen) == logits.shape[0]
    # float32 and contiguous (flat indices): logits itself where it is both, else a copy
    scores = (logits if every else logits[chosen]).float().contiguous()
    asking = [rows[row] for row in chosen]
    _bias(scores, [params.logit_bias for params, _, _ in asking])
    _repetition(scores, asking)
    _frequency_and_presence(scores, asking)
    if every:
        if scores is not logits:
            logits.copy_(scores)
    else:
        logits[chosen] = scores.to(logits.dtype)


def token_pairs(histories: Sequence[Sequence[Sequence[int]]], rows: Sequence[int], vocab: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct (row, token) pairs of the histories (each given as its parts: the
    prompt's ids, the generated ones) as flat indices into a contiguous (batch, vocab)
    tensor (``rows``: each history's row there), and how many times each token occurs
    in its history. Only the tokens that occur are touched (a few hundred a row, where a
    dense count would be the whole vocabulary's row)."""
    ids = torch.frombuffer(array("q", chain.from_iterable(chain.from_iterable(histories))),
                           dtype=torch.int64)
    lengths = torch.tensor([sum(len(part) for part in parts) for parts in histories])
    owners = torch.repeat_interleave(torch.tensor(rows, dtype=torch.int64), lengths)
    flat, counts = (owners * vocab + ids).unique(return_counts=True)
    return flat.to(device), counts.to(device=device, dtype=torch.float32)


def _per_pair(values: list[float], flat: torch.Tensor, rows: list[int], vocab: int
              ) -> torch.Tensor:
    """Each pair's value of its row (``values`` in ``rows``' order; ``rows`` ascending)."""
    table = torch.tensor(values, device=flat.device)
    owners = torch.searchsorted(torch.tensor(rows, device=flat.device), flat // vocab)
    return table[owners]


def _bias(scores: torch.Tensor, biases: list[tuple[tuple[int, float], ...]]) -> None:
    """Add each row's bias to its named tokens (a ruled-out token's -inf stays -inf)."""
    pairs = [(row, token, bias) for row, entries in enumerate(biases)
             for token, bias in entries]
    if not pairs:
        return
    rows, tokens, values = zip(*pairs, strict=True)
    index = (torch.tensor(rows, device=scores.device), torch.tensor(tokens, device=scores.device))
    scores.index_put_(index, torch.tensor(values, device=scores.device), accumulate=True)


def _repetition(scores: torch.Tensor, asking: list[Row]) -> None:
    """vLLM's repetition penalty over the prompt and the generated tokens: a logit of a
    token seen is divided by the penalty where positive, multiplied where not."""
    picked = [i for i, (params, _, _) in enumerate(asking) if params.repetition_penalty != 1.0]
    if not picked:
        return
    vocab = scores.shape[1]
    flat, _ = token_pairs([asking[i][1:] for i in picked], picked, vocab, scores.device)
    penalty = _per_pair([asking[i][0].repetition_penalty for i in picked], flat, picked, vocab)
    cells = scores.view(-1)
    values = cells[flat]
    cells[flat] = torch.where(values > 0, values / penalty, values * penalty)


def _frequency_and_presence(scores: torch.Tensor, asking: list[Row]) -> None:
    """OpenAI's: ``logit -= frequency_penalty * count + presence_penalty * (count > 0)``,
    the counts over the generated tokens only."""
    picked = [i for i, (params, _, generated) in enumerate(asking)
              if (params.frequency_penalty or params.presence_penalty) and generated]
    if not picked:
        return
    vocab = scores.shape[1]
    flat, counts = token_pairs([asking[i][2:] for i in picked], picked, vocab, scores.device)
    frequency = _per_pair([asking[i][0].frequency_penalty for i in picked], flat, picked, vocab)
    presence = _per_pair([asking[i][0].presence_penalty for i in picked], flat, picked, vocab)
    cells = scores.view(-1)
    cells[flat] -= frequency * counts + presence
