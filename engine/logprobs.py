"""Log-probabilities of generated tokens: a sampled row's numbers, and the event's form.

Only the rows whose request asked (``SamplingParams.logprobs``) pay for them. The model
side (``sampling.sample``, torch) computes them in the step, from the logits the row was
sampled from, for all those rows at once, and hands each such row's outcome back as a
``Sampled`` in place of the bare token id; a row that did not ask gets its token id as
before, so a runner that never computes them (a scripted one) still works. The
scheduler's per-sequence error boundary turns a ``Sampled`` into the event's
``TokenLogprobs`` (``event_logprobs``), with each token's text from ``TokenTexts``.

Which distribution: see ``types.TokenLogprobs`` (after the temperature, before top-k and
top-p). Concurrent equals solo: a row's token never depends on its batch mates, and its
log-probabilities agree with a solo run's within float rounding of the logits (the
batched matmuls may round differently); ``tests/test_engine_logprobs.py`` states the
tolerance. Pure Python: no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from .types import TokenLogprobs

# The least log-probability reported: a token whose logit is -inf (ruled out by the
# model) would be -inf, which JSON cannot hold; OpenAI reports such a token at -9999.
MIN_LOGPROB = -9999.0


@dataclass(frozen=True, slots=True)
class Sampled:
    """A row's outcome when its request asked for log-probabilities: the token sampled,
    its log-probability and the row's likeliest ``top_logprobs`` (id, logprob), likeliest
    first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


Outcome = int | Sampled | Exception  # a row's: its token, with logprobs, or what sampling raised


def token_id_of(outcome: int | Sampled) -> int:
    return outcome.token_id if isinstance(outcome, Sampled) else outcome


class TokenTexts:
    """Each token's text decoded alone (special tokens included), memoized: at most one
    string per token of the vocabulary, shared by every event that names it. For the
    stepping thread only: it uses the decoding tokenizer.

    Args:
        tokenizer: the model's tokenizer (a fast one's Rust backend is called directly).
    """

    def __init__(self, tokenizer: Any) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        source = backend if backend is not None else tokenizer
        self._decode: Callable[[list[int]], str] = partial(source.decode,
                                                           skip_special_tokens=False)
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._decode([token_id])
        return text


def event_logprobs(sampled: Sampled, text_of: Callable[[int], str]) -> TokenLogprobs:
    """The event's form of a row's log-probabilities, texts by ``text_of``."""
    return TokenLogprobs(text_of(sampled.token_id), sampled.logprob,
                         tuple((i, text_of(i), value) for i, value in sampled.top))
