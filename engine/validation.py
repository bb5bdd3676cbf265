"""Checks on a request before it is queued: plain Python, no torch.

The sampling limits are defined here once and exported at the engine root, so that
the HTTP schemas refuse exactly what the engine would refuse (a 422 there instead of
an engine error later) without copying the numbers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from .errors import InvalidMaxNewTokens, InvalidRequest, InvalidSampling, InvalidTokenId
from .prefix_cache import MAX_NAMESPACE_BYTES
from .types import GenerationRequest, SamplingParams

MIN_TEMPERATURE = 0.0
"""Temperature 0 means greedy; negative temperatures have no meaning."""
MAX_TEMPERATURE = 100.0
"""Beyond this the distribution is uniform for any practical purpose."""
MIN_TOP_P = 0.0
"""Exclusive: top_p must be greater than this (0 would keep no token)."""
MAX_TOP_P = 1.0
"""Inclusive: 1 keeps every token."""
MIN_TOP_K = 0
"""Inclusive: 0 means no top-k cut."""
MIN_SEED = 0
MAX_SEED = 2**63 - 1
"""Inclusive: a seed must fit a signed 64-bit generator seed."""
MAX_TOP_LOGPROBS = 20
"""Inclusive: the likeliest tokens a step reports per token (OpenAI's chat allows 20)."""
MAX_PENALTY = 2.0
"""Inclusive: ``presence_penalty`` and ``frequency_penalty`` lie in [-2, 2] (OpenAI's)."""
MAX_LOGIT_BIAS = 100.0
"""Inclusive: a ``logit_bias`` value lies in [-100, 100] (OpenAI's)."""
MAX_LOGIT_BIAS_ENTRIES = 300
"""Inclusive: the most token ids one ``logit_bias`` may name (OpenAI's limit)."""


def validate_request(request: GenerationRequest) -> None:
    """Raise InvalidMaxNewTokens or InvalidSampling for what no step can honour."""
    max_new = request.max_new_tokens
    if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1:
        raise InvalidMaxNewTokens(f"max_new_tokens must be an integer >= 1, got {max_new!r}")
    namespace = request.cache_namespace
    if not isinstance(namespace, bytes) or len(namespace) > MAX_NAMESPACE_BYTES:
        raise InvalidRequest(f"cache_namespace must be at most {MAX_NAMESPACE_BYTES} bytes")
    validate_sampling(request.sampling)


def validate_sampling(params: SamplingParams) -> None:
    """Raise InvalidSampling for values no sampler can honour."""
    t, p, k, seed = params.temperature, params.top_p, params.top_k, params.seed
    if not (
        isinstance(t, int | float) and math.isfinite(t) and MIN_TEMPERATURE <= t <= MAX_TEMPERATURE
    ):
        raise InvalidSampling(f"temperature must be a number in [0, 100], got {t!r}")
    if not (isinstance(p, int | float) and math.isfinite(p) and MIN_TOP_P < p <= MAX_TOP_P):
        raise InvalidSampling(f"top_p must be in (0, 1], got {p!r}")
    if isinstance(k, bool) or not isinstance(k, int) or k < MIN_TOP_K:
        raise InvalidSampling(f"top_k must be an integer >= 0, got {k!r}")
    if seed is not None and (
        isinstance(seed, bool) or not isinstance(seed, int) or not MIN_SEED <= seed <= MAX_SEED
    ):
        raise InvalidSampling(f"seed must be an integer in [0, 2**63), got {seed!r}")
    logprobs, top = params.logprobs, params.top_logprobs
    if not isinstance(logprobs, bool):
        raise InvalidSampling(f"logprobs must be a boolean, got {logprobs!r}")
    if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS:
        raise InvalidSampling(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], "
                              f"got {top!r}")
    if top and not logprobs:
        raise InvalidSampling("top_logprobs needs logprobs")
    validate_penalties(params)


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def validate_penalties(params: SamplingParams) -> None:
    """Raise InvalidSampling for a penalty or a ``logit_bias`` out of range (its token
    ids are checked against the vocabulary by ``validate_given_ids``, which knows it)."""
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(params, name)
        if not (_number(value) and -MAX_PENALTY <= value <= MAX_PENALTY):
            raise InvalidSampling(f"{name} must be a number in [-2, 2], got {value!r}",
                                  param=name)
    repetition = params.repetition_penalty
    if not (_number(repetition) and repetition > 0):
        raise InvalidSampling(f"repetition_penalty must be a number > 0, got {repetition!r}",
                              param="repetition_penalty")
    bias = params.logit_bias
    if not isinstance(bias, tuple) or len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidSampling(f"logit_bias may name at most {MAX_LOGIT_BIAS_ENTRIES} tokens",
                              param="logit_bias")
    for pair in bias:
        if not (isinstance(pair, tuple) and len(pair) == 2 and type(pair[0]) is int
                and _number(pair[1]) and -MAX_LOGIT_BIAS <= pair[1] <= MAX_LOGIT_BIAS):
            raise InvalidSampling("logit_bias must pair token ids with numbers in "
                                  f"[-100, 100], got {pair!r}", param="logit_bias")
    if len({token for token, _ in bias}) != len(bias):
        raise InvalidSampling("logit_bias names a token id twice", param="logit_bias")


def vocab_size_of(loaded: Any) -> int | None:
    """How many token ids the model takes: the rows of its input embedding (what a
    lookup indexes; a model may pad it past its tokenizer, and may sample those ids), else
    a ``vocab_size`` the source declares, else its tokenizer's length; None if none is
    known (a scripted tokenizer), and then only negative ids are refused."""
    model = getattr(loaded, "model", None)
    embeddings = getattr(model, "get_input_embeddings", None)
    if callable(embeddings):
        rows = getattr(embeddings(), "num_embeddings", None)
        if isinstance(rows, int):
            return rows
    declared = getattr(loaded, "vocab_size", None)
    if isinstance(declared, int) and not isinstance(declared, bool):
        return declared
    tokenizer = getattr(loaded, "tokenizer", None)
    try:
        return len(tokenizer)  # type: ignore[arg-type]
    except TypeError:
        return None


def validate_token_ids(ids: Sequence[int], vocab_size: int | None, what: str) -> None:
    """Raise InvalidTokenId unless every id is an integer in ``[0, vocab_size)``.

    ``what`` names the ids in the message (``prompt_token_ids``, ``resume_from``); the
    message names the first bad id and its position, never the others. About 1 ms for
    30,000 ids.
    """
    if not ids:
        return
    if set(map(type, ids)) != {int}:
        bad = next(n for n, i in enumerate(ids) if type(i) is not int)
        raise InvalidTokenId(f"{what}[{bad}] is not an integer token id: {ids[bad]!r}",
                             param=what)
    low, high = min(ids), max(ids)
    if low >= 0 and (vocab_size is None or high < vocab_size):
        return
    bad = next(n for n, i in enumerate(ids) if i < 0 or (vocab_size is not None
                                                          and i >= vocab_size))
    bound = "" if vocab_size is None else f", below the vocabulary's size {vocab_size}"
    raise InvalidTokenId(f"{what}[{bad}] is {ids[bad]}: a token id must be >= 0{bound}",
                         param=what)


def validate_given_ids(
    request: GenerationRequest, resume_from: Sequence[int], vocab_size: int | None
) -> None:
    """``validate_token_ids`` for what ``Engine.submit`` is given rather than encodes:
    a request's ``prompt_token_ids`` (None: the engine encodes the prompt itself), the
    tokens its ``logit_bias`` names (an id past the logits' row would fail its step, or
    on a GPU end the process's CUDA use), and the tokens a rebuilt stream resumes from
    (``resume_from``)."""
    if request.prompt_token_ids is not None:
        validate_token_ids(request.prompt_token_ids, vocab_size, "prompt_token_ids")
    validate_token_ids([token for token, _ in request.sampling.logit_bias], vocab_size,
                       "logit_bias")
    validate_token_ids(resume_from, vocab_size, "resume_from")
