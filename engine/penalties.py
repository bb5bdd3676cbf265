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
ask are gathered, changed in float32 and written back.
"""

from __future__ import annotations

from collections.abc import Sequence

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
    scores = logits.float() if every else logits[chosen].float()  # a copy: written back
    asking = [rows[row] for row in chosen]
    _bias(scores, [params.logit_bias for params, _, _ in asking])
    _repetition(scores, asking)
    _frequency_and_presence(scores, asking)
    if every:
        logits.copy_(scores)
    else:
        logits[chosen] = scores.to(logits.dtype)


def token_counts(histories: Sequence[Sequence[int]], vocab: int,
                 device: torch.device) -> torch.Tensor:
    """(rows, vocab) float32: how many times each token occurs in each row's history,
    by one ``scatter_add`` over the histories padded with a column past the vocabulary."""
    width = max((len(h) for h in histories), default=0)
    counts = torch.zeros(len(histories), vocab + 1, device=device)
    if width:
        ids = torch.tensor([list(h) + [vocab] * (width - len(h)) for h in histories],
                           device=device, dtype=torch.long)
        counts.scatter_add_(1, ids, torch.ones(ids.shape, device=device))
    return counts[:, :vocab]


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
    seen = token_counts([list(asking[i][1]) + list(asking[i][2]) for i in picked],
                        scores.shape[1], scores.device) > 0
    penalty = torch.tensor([asking[i][0].repetition_penalty for i in picked],
                           device=scores.device).unsqueeze(1)
    part = scores[picked]
    penalised = torch.where(part > 0, part / penalty, part * penalty)
    scores[picked] = torch.where(seen, penalised, part)


def _frequency_and_presence(scores: torch.Tensor, asking: list[Row]) -> None:
    """OpenAI's: ``logit -= frequency_penalty * count + presence_penalty * (count > 0)``,
    the counts over the generated tokens only."""
    picked = [i for i, (params, _, generated) in enumerate(asking)
              if (params.frequency_penalty or params.presence_penalty) and generated]
    if not picked:
        return
    counts = token_counts([asking[i][2] for i in picked], scores.shape[1], scores.device)
    frequency = torch.tensor([asking[i][0].frequency_penalty for i in picked],
                             device=scores.device).unsqueeze(1)
    presence = torch.tensor([asking[i][0].presence_penalty for i in picked],
                            device=scores.device).unsqueeze(1)
    scores[picked] -= frequency * counts + presence * (counts > 0).float()
