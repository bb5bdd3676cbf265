"""``sampling.greedy`` picks what ``argmax`` picks: the first of tied maxima, a NaN's
index when a row holds one, in every precision (it is taken as ``max(dim).indices``,
which measured faster on the CPU: ``python -m tools.bench overhead``)."""

from __future__ import annotations

import pytest
import torch

from engine import sampling


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_equals_argmax_on_ties_nan_and_random_rows(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 1000, generator=generator).to(dtype)
    logits[0] = 0.0  # every logit tied: the first
    logits[1, [5, 17, 900]] = 50.0  # three tied maxima
    logits[2, 321] = float("nan")
    logits[3, :] = float("-inf")
    logits[3, 999] = 1.0
    expected = logits.argmax(dim=-1).tolist()
    assert sampling.greedy(logits) == expected
    assert expected[:4] == [0, 5, 321, 999]


def test_greedy_of_a_step_shaped_view_equals_argmax() -> None:
    """The runner hands ``logits[:, -1, :]`` of a (rows, 1, vocab) output."""
    out = torch.randn(32, 1, 4096, generator=torch.Generator().manual_seed(1))
    view = out[:, -1, :]
    assert sampling.greedy(view) == view.argmax(dim=-1).tolist()
