"""Checks on a request before it is queued: plain Python, no torch."""

from __future__ import annotations

import math

from .errors import InvalidMaxNewTokens, InvalidSampling
from .types import GenerationRequest, SamplingParams


def validate_request(request: GenerationRequest) -> None:
    """Raise InvalidMaxNewTokens or InvalidSampling for what no step can honour."""
    max_new = request.max_new_tokens
    if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1:
        raise InvalidMaxNewTokens(f"max_new_tokens must be an integer >= 1, got {max_new!r}")
    validate_sampling(request.sampling)


def validate_sampling(params: SamplingParams) -> None:
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
